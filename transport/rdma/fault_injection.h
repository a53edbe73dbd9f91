// Fault injection for the RDMA transport's tests, off unless a test arms it.
//
// Production code only reads these (one relaxed atomic load on the
// large-payload path, per batch of posts and per connect); tests arm them
// to make a peer misbehave, or a thread stop at a chosen point, on purpose.
#ifndef RDMARPC_TRANSPORT_RDMA_FAULT_INJECTION_H_
#define RDMARPC_TRANSPORT_RDMA_FAULT_INJECTION_H_

#include <errno.h>
#include <sys/eventfd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <thread>

namespace rdmarpc::transport::rdma {

struct FaultInjection {
  // The next N payload advertisements carry a wrong rkey.
  static std::atomic<int>& CorruptRkeys() {
    static std::atomic<int> n{0};
    return n;
  }
  static bool TakeCorruptRkey() { return Take(CorruptRkeys()); }

  // The next N payload fetches READ the previous advertisement on their
  // connection instead, as a peer replaying an old (addr, rkey) would.
  static std::atomic<int>& StaleReads() {
    static std::atomic<int> n{0};
    return n;
  }
  static bool TakeStaleRead() { return Take(StaleReads()); }

  // The next N wake-up descriptors made for `whose` fail with EMFILE, as in a
  // process out of file descriptors (NewWakeFd).
  enum class WakeFdOf { kTransport, kEndpoint, kDeviceEvents, kCount };
  static std::atomic<int>& FailWakeFds(WakeFdOf whose) {
    static std::atomic<int> n[static_cast<int>(WakeFdOf::kCount)]{};
    return n[static_cast<int>(whose)];
  }
  static bool TakeFailedWakeFd(WakeFdOf whose) { return Take(FailWakeFds(whose)); }

  // The next N send slots asked of an endpoint are refused, as when all of
  // its stock is held by SENDs in flight.
  static std::atomic<int>& RefuseSendBlocks() {
    static std::atomic<int> n{0};
    return n;
  }
  static bool TakeRefusedSendBlock() { return Take(RefuseSendBlocks()); }

  // The next N registrations of memory fail (RegisterWithinLockedLimit), as
  // ibv_reg_mr does with ENOMEM past the locked-memory limit.
  static std::atomic<int>& FailRegistrations() {
    static std::atomic<int> n{0};
    return n;
  }
  static bool TakeFailedRegistration() { return Take(FailRegistrations()); }

  // The next N queue pairs fail to be created (RdmaConnection::CreateQp), as
  // rdma_create_qp does with ENOMEM when the device has no more.
  static std::atomic<int>& FailQpCreations() {
    static std::atomic<int> n{0};
    return n;
  }
  static bool TakeFailedQpCreation() { return Take(FailQpCreations()); }

  // The next N resizes of a completion queue are not made; ibv_resize_cq
  // answers CqResizeAnswer() instead (Endpoint::ReserveCompletions):
  // EOPNOTSUPP, as a device without resize (siw) does; ENOMEM, as when the
  // kernel cannot allocate the larger queue; or 0, success with the queue
  // left as it was, as qedr's kernel driver once did.
  static std::atomic<int>& FakeCqResizes() {
    static std::atomic<int> n{0};
    return n;
  }
  static std::atomic<int>& CqResizeAnswer() {
    static std::atomic<int> answer{0};
    return answer;
  }
  static std::optional<int> TakeFakedCqResize() {
    if (!Take(FakeCqResizes())) return std::nullopt;
    return CqResizeAnswer().load();
  }

  // The next N connection requests a server accepts fail to be accepted, as
  // rdma_accept does when the device or the CM gives up (ENOMEM here).
  static std::atomic<int>& FailAccepts() {
    static std::atomic<int> n{0};
    return n;
  }
  static bool TakeFailedAccept() { return Take(FailAccepts()); }

  // The next N refills of an SRQ fail before reaching the device, as
  // ibv_post_srq_recv does with ENOMEM for the batch's first request.
  static std::atomic<int>& FailSrqPosts() {
    static std::atomic<int> n{0};
    return n;
  }
  static bool TakeFailedSrqPost() { return Take(FailSrqPosts()); }

  // Armed by a test thread: that thread's next batch of work requests waits
  // just before ibv_post_send (holding the connection's post token, and no
  // lock) until ReleaseHeldPost.
  static void HoldNextPostOfThisThread() { ArmPost(/*fail=*/false); }
  // Armed by a test thread: that thread's next batch of work requests fails
  // before reaching the device, as ibv_post_send does with ENOMEM (a full
  // send queue) for the batch's first request.
  static void FailNextPostOfThisThread() { ArmPost(/*fail=*/true); }
  // The same for the next batch that any thread posts: a poller's or a
  // timer's, such as a keepalive, which ends its connection with no peer
  // asking for it.
  static void FailNextPostOfAnyThread() { ArmPost(/*fail=*/true, /*any_thread=*/true); }
  static void WaitUntilPostHeld() {
    Hold& h = HoldState();
    std::unique_lock<std::mutex> lock(h.mu);
    h.cv.wait(lock, [&] { return h.held; });
  }
  static void ReleaseHeldPost() {
    Hold& h = HoldState();
    std::lock_guard<std::mutex> lock(h.mu);
    h.released = true;
    h.cv.notify_all();
  }

  // Armed by a test: the next RDMA connect to succeed, its connection made
  // and its observer attached, waits before returning to its caller until
  // ReleaseHeldConnects, so that what the peer does meanwhile (a GOAWAY, a
  // close) reaches the observer before the caller has the connection. Of a
  // name's addresses (address_race.h), the one that connected first waits,
  // and the others are asked meanwhile.
  static void HoldNextConnect() { connect_armed_.store(true); }
  // False when no connect was waiting within `within`.
  static bool WaitUntilConnectHeld(std::chrono::milliseconds within) {
    ConnectHold& h = ConnectHoldState();
    std::unique_lock<std::mutex> lock(h.mu);
    return h.cv.wait_for(lock, within, [&] { return h.held > h.released; });
  }
  // Lets the connects held so far return; one armed and not yet come is
  // still held when it comes.
  static void ReleaseHeldConnects() {
    ConnectHold& h = ConnectHoldState();
    std::lock_guard<std::mutex> lock(h.mu);
    h.released = h.held;
    h.cv.notify_all();
  }
  // For a test's way out: disarms, and releases what is held.
  static void StopHoldingConnects() {
    connect_armed_.store(false);
    ReleaseHeldConnects();
  }
  // For a test: holds the next connect while it lives, and lets go of every
  // connect held on its way out, so that a test that ends early does not
  // leave a channel's destructor waiting for ever on its connect. Make it
  // after the channel.
  struct HeldConnects {
    HeldConnects() { HoldNextConnect(); }
    ~HeldConnects() { StopHoldingConnects(); }
    HeldConnects(const HeldConnects&) = delete;
    HeldConnects& operator=(const HeldConnects&) = delete;
  };
  // RdmaTransport, as a connect on one address succeeds.
  static void AfterConnect() {
    if (!connect_armed_.load(std::memory_order_relaxed)) return;
    ConnectHold& h = ConnectHoldState();
    std::unique_lock<std::mutex> lock(h.mu);
    if (!connect_armed_.exchange(false)) return;
    const uint64_t ticket = ++h.held;
    h.cv.notify_all();
    h.cv.wait(lock, [&] { return h.released >= ticket; });
  }

  // The poster, just before ibv_post_send; true when the post must fail.
  // One relaxed load of a constant-initialized flag when disarmed (no guard
  // for a function-local static, no call), since it runs on every post.
  static bool BeforePost() {
    if (post_armed_.load(std::memory_order_relaxed)) return OnArmedPost();
    return false;
  }

 private:
  struct Hold {
    std::mutex mu;
    std::condition_variable cv;
    std::thread::id who;    // guarded by mu; none: any thread
    bool fail = false;      // guarded by mu
    bool held = false;      // guarded by mu
    bool released = false;  // guarded by mu
  };
  static Hold& HoldState() {
    static Hold h;
    return h;
  }
  struct ConnectHold {
    std::mutex mu;
    std::condition_variable cv;
    uint64_t held = 0;      // guarded by mu: connects held, ever
    uint64_t released = 0;  // guarded by mu: of those, the ones let go
  };
  static ConnectHold& ConnectHoldState() {
    static ConnectHold h;
    return h;
  }
  static inline std::atomic<bool> post_armed_{false};
  static inline std::atomic<bool> connect_armed_{false};

  static void ArmPost(bool fail, bool any_thread = false) {
    Hold& h = HoldState();
    std::lock_guard<std::mutex> lock(h.mu);
    h.who = any_thread ? std::thread::id() : std::this_thread::get_id();
    h.fail = fail;
    h.held = h.released = false;
    post_armed_.store(true);
  }
  static bool OnArmedPost() {
    Hold& h = HoldState();
    std::unique_lock<std::mutex> lock(h.mu);
    if (!post_armed_.load() ||
        (h.who != std::thread::id() && h.who != std::this_thread::get_id())) {
      return false;
    }
    post_armed_.store(false);
    if (h.fail) return true;
    h.held = true;
    h.cv.notify_all();
    h.cv.wait(lock, [&] { return h.released; });
    return false;
  }

  static bool Take(std::atomic<int>& n) {
    int v = n.load(std::memory_order_relaxed);
    while (v > 0 && !n.compare_exchange_weak(v, v - 1)) {
    }
    return v > 0;
  }
};

// An eventfd for waking `whose` thread, or -1 with errno set (EMFILE when a
// test has FaultInjection::FailWakeFds armed for it).
inline int NewWakeFd(FaultInjection::WakeFdOf whose) {
  if (FaultInjection::TakeFailedWakeFd(whose)) {
    errno = EMFILE;
    return -1;
  }
  return eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
}

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_FAULT_INJECTION_H_
