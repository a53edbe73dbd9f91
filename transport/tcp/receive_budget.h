// ReceiveBudget: the bound on the payload bytes one TCP transport holds
// received, across all its connections (TcpOptions::max_receive_bytes).
//
// Why it exists: a peer chooses how large its messages are (up to
// max_message_size) and nothing bounds how many peers connect, so many peers
// each sending a large frame at once could grow a server to all its host
// has. Over RDMA the registered pool's bound (RdmaOptions::
// max_registered_bytes) already caps this; this is TCP's counterpart.
//
//   ReceiveBudget* budget = ReceiveBudget::New(1 << 30, quota);  // the owner's reference
//   std::optional<ReceiveBudget::Incoming> in = budget->Allocate(len);
//   // per read(2) into in->data():  if (!in->Count(n)) { refuse: budget->Exceeded(...) }
//   Buffer payload = std::move(*in).Take();                      // once all `len` bytes came
//   budget->Drop();                                              // payloads may outlive it
//
// What it counts, and what not to rely on:
// - Bytes count as they arrive, not when a header announces them. A peer that
//   announces a large frame and sends nothing holds no memory (the
//   allocation commits no page until it is written), and must not be able to
//   hold the bound either, which would refuse every other peer's messages.
//   So a frame that fitted when its header came can still be refused part
//   way, when other frames filled the bound meanwhile.
// - A payload counts until its Buffer is released, which can be long after
//   it was delivered (a response attachment the caller keeps) and after the
//   transport is gone. So the budget is freed by whichever lets go last: the
//   owner (Drop) or the payloads. One atomic word holds both, the owner's
//   share as kOwner, so a payload costs one read-modify-write when its bytes
//   arrive and one when it is released (two each with a memory quota), with
//   no reference count of its own.
// - Bytes counted count against the memory quota too, when there is one
//   (transport/memory_quota.h), as long as they count here; the budget
//   keeps the quota alive until they are released.
// - Metadata (at most kMaxMetadataBytes a frame, which takes memory only as
//   its bytes arrive) is not counted, nor is what waits to be sent
//   (TcpOptions::max_queued_send_bytes and max_queued_send_bytes_total bound
//   that).
#ifndef RDMARPC_TRANSPORT_TCP_RECEIVE_BUDGET_H_
#define RDMARPC_TRANSPORT_TCP_RECEIVE_BUDGET_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "transport/buffer.h"
#include "transport/memory_quota.h"

namespace rdmarpc::transport {

class ReceiveBudget {
 public:
  // A budget of `bound` bytes, within `quota` when not null, and its owner's
  // reference, which Drop gives back.
  static ReceiveBudget* New(size_t bound, std::shared_ptr<MemoryQuota> quota = nullptr);
  // The owner lets go. Fits, Count and held need the owner's reference.
  void Drop();

  // A payload on its way in: its memory, and how much of it has arrived and
  // been counted. Destroyed before all of it came (a refused or broken
  // frame), it gives back what it counted.
  class Incoming {
   public:
    Incoming(Incoming&& other) noexcept;
    Incoming& operator=(Incoming&& other) noexcept;
    ~Incoming() { GiveBack(); }

    char* data() const { return data_.get(); }
    size_t size() const { return size_; }
    // Counts `bytes` more of it as arrived; false, counting nothing, when
    // that would take the budget past its bound, or the quota past its own.
    bool Count(size_t bytes);
    // The payload, once all of it is counted: a Buffer that gives its bytes
    // back to the budget when released.
    Buffer Take() &&;

   private:
    friend class ReceiveBudget;
    Incoming(ReceiveBudget* budget, std::unique_ptr<char[]> data, size_t size)
        : budget_(budget), data_(std::move(data)), size_(size) {}
    void GiveBack();

    ReceiveBudget* budget_;
    std::unique_ptr<char[]> data_;
    size_t size_;
    size_t counted_ = 0;
  };

  // Memory for a payload of `size` (> 0) bytes, none of it counted yet;
  // nullopt when the process has none to give.
  std::optional<Incoming> Allocate(size_t size);

  // Whether `bytes` more fit under the bound, and the quota's, now: where
  // only the quota has no room, idle memory reserved on it (another
  // transport's) is given back first (MemoryQuota::MakeRoom).
  bool Fits(size_t bytes) { return FitsOwnBound(bytes) && (!quota_ || quota_->MakeRoom(bytes)); }
  // Bytes counted now: arrived, and not yet released.
  size_t held() const { return value_.load(std::memory_order_relaxed) - kOwner; }
  // RESOURCE_EXHAUSTED for a message of `bytes` from `from` ("tcp://...")
  // that does not fit: names the option (or the quota, when it is the
  // quota that has no room), the bound and what is held.
  absl::Status Exceeded(size_t bytes, absl::string_view from) const;

 private:
  // The owner's share of value_: more than any count of bytes can reach
  // (an address space holds far less), so value_ is 0 only once the owner
  // and every payload have let go.
  static constexpr uint64_t kOwner = uint64_t{1} << 63;

  ReceiveBudget(size_t bound, std::shared_ptr<MemoryQuota> quota)
      : bound_(bound), quota_(std::move(quota)) {}
  bool FitsOwnBound(size_t bytes) const { return bytes <= bound_ && held() <= bound_ - bytes; }
  // Gives back `bytes` (or the owner's share), freeing the budget on the
  // last.
  void Release(uint64_t bytes);

  const size_t bound_;
  const std::shared_ptr<MemoryQuota> quota_;
  std::atomic<uint64_t> value_{kOwner};
};

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_TCP_RECEIVE_BUDGET_H_
