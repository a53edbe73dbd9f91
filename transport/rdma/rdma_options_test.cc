// RdmaOptionsFromEnv and CheckRdmaOptions: the environment overrides only
// well-formed values, and options that cannot work are refused by Listen and
// Connect with the option's name, before any device is looked at (so this
// runs on the host, device or not).
#include "transport/rdma/rdma_options.h"

#include <cstdlib>

#include "gtest/gtest.h"
#include "transport/rdma/rdma_transport.h"

namespace rdmarpc::transport::rdma {
namespace {

class EnvVar {
 public:
  EnvVar(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~EnvVar() { unsetenv(name_); }

 private:
  const char* name_;
};

TEST(RdmaOptionsFromEnv, ReadsWellFormedValues) {
  EnvVar poll("RDMARPC_RDMA_POLL", "busy");
  EnvVar slot("RDMARPC_RDMA_SLOT_SIZE", "4096");
  EnvVar gid("RDMARPC_RDMA_GID_INDEX", "3");
  EnvVar keepalive("RDMARPC_RDMA_KEEPALIVE_MS", "0");
  EnvVar trace("RDMARPC_RDMA_TRACE", "1");
  EnvVar rnr("RDMARPC_RDMA_RNR_WAIT_US", "100");
  EnvVar tos("RDMARPC_RDMA_TOS", "104");
  EnvVar strict("RDMARPC_RDMA_STRICT_CREDITS", "1");
  EnvVar accept("RDMARPC_RDMA_ACCEPT_TIMEOUT_MS", "2500");
  const RdmaOptions o = RdmaOptionsFromEnv();
  EXPECT_EQ(o.accept_timeout_ms, 2500u);
  EXPECT_TRUE(o.trace);
  EXPECT_TRUE(o.strict_credits);
  EXPECT_EQ(o.type_of_service, 104);
  EXPECT_EQ(o.rnr_wait_us, 100u);
  EXPECT_EQ(o.poll_mode, PollMode::kBusy);
  EXPECT_EQ(o.slot_size, 4096u);
  EXPECT_EQ(o.gid_index, 3);
  EXPECT_EQ(o.keepalive_ms, 0u);
  EXPECT_EQ(o.peer_timeout_ms, RdmaOptions{}.peer_timeout_ms);
}

// Options set in code stand where the environment says nothing, and give
// way where it does (it is for experiments on a built program); a malformed
// value keeps the code's, not the default.
TEST(RdmaOptionsFromEnv, OverridesTheCodesOptionsOnlyWhereSet) {
  RdmaOptions code;
  code.poll_mode = PollMode::kEvent;
  code.credits = 8;
  code.slot_size = 2048;
  code.device = "mlx5_1";
  EnvVar credits("RDMARPC_RDMA_CREDITS", "12");
  EnvVar backlog("RDMARPC_RDMA_MAX_BACKLOG_BYTES", "65536");
  EnvVar backlog_total("RDMARPC_RDMA_MAX_BACKLOG_BYTES_TOTAL", "1048576");
  EnvVar poll("RDMARPC_RDMA_POLL", "sometimes");
  const RdmaOptions o = RdmaOptionsFromEnv(code);
  EXPECT_EQ(o.credits, 12u);
  EXPECT_EQ(o.max_backlog_bytes, 65536u);
  EXPECT_EQ(o.max_backlog_bytes_total, 1048576u);
  EXPECT_EQ(o.poll_mode, PollMode::kEvent);
  EXPECT_EQ(o.slot_size, 2048u);
  EXPECT_EQ(o.device, "mlx5_1");
  EXPECT_EQ(o.keepalive_ms, code.keepalive_ms);
}

// strtoull read "soon" as 0, which for these options means "no keepalive" or
// "the device's default timeout", and "8k" as 8: a typo silently changed
// behaviour. Now a malformed value keeps the default.
TEST(RdmaOptionsFromEnv, MalformedValuesChangeNothing) {
  const RdmaOptions defaults;
  for (const char* bad : {"soon", "8k", "-1", "99999999999999999999", " "}) {
    EnvVar keepalive("RDMARPC_RDMA_KEEPALIVE_MS", bad);
    EnvVar slot("RDMARPC_RDMA_SLOT_SIZE", bad);
    EnvVar credits("RDMARPC_RDMA_CREDITS", bad);
    EnvVar poll("RDMARPC_RDMA_POLL", bad);
    EnvVar trace("RDMARPC_RDMA_TRACE", bad);
    EnvVar strict("RDMARPC_RDMA_STRICT_CREDITS", bad);
    const RdmaOptions o = RdmaOptionsFromEnv();
    EXPECT_EQ(o.trace, defaults.trace) << bad;
    EXPECT_EQ(o.strict_credits, defaults.strict_credits) << bad;
    EXPECT_EQ(o.keepalive_ms, defaults.keepalive_ms) << bad;
    EXPECT_EQ(o.slot_size, defaults.slot_size) << bad;
    EXPECT_EQ(o.credits, defaults.credits) << bad;
    EXPECT_EQ(o.poll_mode, defaults.poll_mode) << bad;
  }
  EnvVar gid("RDMARPC_RDMA_GID_INDEX", "1x");
  EXPECT_EQ(RdmaOptionsFromEnv().gid_index, -1);
}

TEST(CheckRdmaOptions, AcceptsTheDefaultsAndTheSmallestSlot) {
  for (const bool listening : {true, false}) {
    SCOPED_TRACE(listening ? "server" : "client");
    EXPECT_TRUE(CheckRdmaOptions(RdmaOptions{}, listening).ok());
    RdmaOptions o;
    o.slot_size = kMinSlotSize;
    EXPECT_TRUE(CheckRdmaOptions(o, listening).ok());
    for (uint32_t queues : {1u, kMaxCompletionQueues}) {
      o.max_completion_queues = queues;
      EXPECT_TRUE(CheckRdmaOptions(o, listening).ok()) << queues << " completion queues";
    }
    for (int tos : {-1, 0, 255}) {
      o.type_of_service = tos;
      EXPECT_TRUE(CheckRdmaOptions(o, listening).ok()) << "type of service " << tos;
    }
    for (uint32_t wait : {1u, kLongestRnrWaitUs}) {
      o.rnr_wait_us = wait;
      EXPECT_TRUE(CheckRdmaOptions(o, listening).ok()) << wait << " us RNR wait";
    }
    for (uint32_t ms : {1u, (1u << 31) - 1}) {
      o.connect_timeout_ms = ms;
      EXPECT_TRUE(CheckRdmaOptions(o, listening).ok()) << ms << " ms to resolve";
    }
  }
}

// A completion queue must hold the receives its role keeps posted and one
// connection's send queue, at its shortest (one READ in flight): a server's
// bound of that less one is refused, naming the option and the least that
// works, while a client, with fewer receive slots, may have it.
TEST(CheckRdmaOptions, ACompletionQueueBoundMustHoldTheReceivesAndOneConnection) {
  RdmaOptions o;
  const size_t least = o.server_receive_slots + SendQueueDepth(o, 1);
  ASSERT_GT(o.server_receive_slots, o.client_receive_slots);
  o.max_cq_entries = least;
  EXPECT_TRUE(CheckRdmaOptions(o, /*listening=*/true).ok());
  o.max_cq_entries = least - 1;
  const absl::Status s = CheckRdmaOptions(o, /*listening=*/true);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (const std::string& part :
       {std::string("RdmaOptions::max_cq_entries is "), absl::StrCat("at least ", least),
        std::string("server_receive_slots")}) {
    EXPECT_NE(s.message().find(part), std::string::npos) << part << "\n" << s;
  }
  EXPECT_TRUE(CheckRdmaOptions(o, /*listening=*/false).ok());
  o.max_cq_entries = o.client_receive_slots + SendQueueDepth(o, 1) - 1;
  EXPECT_NE(CheckRdmaOptions(o, /*listening=*/false).message().find("client_receive_slots"),
            std::string::npos);
}

// The wait asked for is rounded up to IBA's table, never down (a shorter
// wait than asked would retry into an SRQ the receiver meant to have time
// to refill), and never to code 0, which waits 655 ms.
TEST(RnrTimerCode, RoundsUpToTheTable) {
  EXPECT_EQ(RnrTimerCode(1), 1);
  EXPECT_EQ(RnrTimerCode(10), 1);
  EXPECT_EQ(RnrTimerCode(11), 2);
  EXPECT_EQ(RnrTimerCode(50), 5);
  EXPECT_EQ(RnrTimerCode(640), 12);
  EXPECT_EQ(RnrTimerCode(641), 13);
  EXPECT_EQ(RnrTimerCode(kLongestRnrWaitUs), 31);
  for (uint32_t us = 1; us <= kLongestRnrWaitUs; us += 997) {
    const uint8_t code = RnrTimerCode(us);
    ASSERT_GE(code, 1) << us;
    ASSERT_GE(RnrTimerMicros(code), us) << "rounded down";
    if (code > 1) {
      ASSERT_LT(RnrTimerMicros(code - 1), us) << "not the shortest that waits " << us;
    }
  }
  EXPECT_EQ(RnrTimerMicros(0), 655360u);
}

TEST(CheckRdmaOptions, NamesTheOptionThatCannotWork) {
  struct Case {
    void (*spoil)(RdmaOptions&);
    const char* named;
  };
  const Case cases[] = {
      {[](RdmaOptions& o) { o.slot_size = kMinSlotSize - 1; }, "slot_size"},
      {[](RdmaOptions& o) { o.slot_size = size_t{1} << 32; }, "slot_size"},
      {[](RdmaOptions& o) { o.server_receive_slots = 0; }, "server_receive_slots"},
      {[](RdmaOptions& o) { o.client_receive_slots = 0; }, "client_receive_slots"},
      {[](RdmaOptions& o) { o.max_held_slots = size_t{1} << 32; }, "max_held_slots"},
      {[](RdmaOptions& o) { o.max_held_slots = (size_t{1} << 32) - 1 - o.server_receive_slots; },
       "max_held_slots"},
      {[](RdmaOptions& o) { o.send_slots = 0; }, "send_slots"},
      {[](RdmaOptions& o) { o.credits = 0; }, "credits"},
      {[](RdmaOptions& o) { o.max_completion_queues = 0; }, "max_completion_queues"},
      {[](RdmaOptions& o) { o.max_completion_queues = kMaxCompletionQueues + 1; },
       "max_completion_queues"},
      {[](RdmaOptions& o) { o.gid_index = -2; }, "gid_index"},
      {[](RdmaOptions& o) { o.type_of_service = -2; }, "type_of_service"},
      {[](RdmaOptions& o) { o.type_of_service = 256; }, "type_of_service"},
      {[](RdmaOptions& o) { o.rnr_wait_us = 0; }, "rnr_wait_us"},
      {[](RdmaOptions& o) { o.rnr_wait_us = kLongestRnrWaitUs + 1; }, "rnr_wait_us"},
      {[](RdmaOptions& o) { o.connect_timeout_ms = 0; }, "connect_timeout_ms"},
      {[](RdmaOptions& o) { o.connect_timeout_ms = 1u << 31; }, "connect_timeout_ms"},
  };
  for (const Case& c : cases) {
    RdmaOptions o;
    c.spoil(o);
    const absl::Status s = CheckRdmaOptions(o, /*listening=*/true);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.named;
    EXPECT_NE(s.message().find(absl::StrCat("RdmaOptions::", c.named)), std::string::npos)
        << s.message();
  }
}

// Strict credits: each connection holds its window and three slots for the
// peer's kCredit frames; the refill's lag is held back from all.
TEST(StrictCreditWindow, GrantsWhatTheSlotsNotSpokenForHoldAndNothingBeyond) {
  // 64 slots, 8 of them refill lag: 56 to grant.
  EXPECT_EQ(StrictCreditWindow(8, 64, 8, 0), 8u);
  EXPECT_EQ(StrictCreditWindow(8, 64, 8, 40), 8u);
  EXPECT_EQ(StrictCreditWindow(8, 64, 8, 50), 3u);   // 56 - 50 - 3
  EXPECT_EQ(StrictCreditWindow(8, 64, 8, 52), 1u);   // one frame still fits
  EXPECT_EQ(StrictCreditWindow(8, 64, 8, 53), 0u);   // its kCredit frames would not
  EXPECT_EQ(StrictCreditWindow(8, 64, 8, 100), 0u);  // more spoken for than there is
  EXPECT_EQ(StrictCreditWindow(8, 8, 8, 0), 0u);     // the lag is the whole SRQ
  EXPECT_EQ(StrictCreditWindow(8, 11, 8, 0), 0u);
  EXPECT_EQ(StrictCreditWindow(8, 12, 8, 0), 1u);
  // What is granted and what it holds never exceed the usable slots.
  for (size_t committed = 0; committed < 60; ++committed) {
    const uint32_t w = StrictCreditWindow(32, 64, 8, committed);
    if (w > 0) {
      EXPECT_LE(committed + w + kCreditFramesPerWindow, 64u - 8u) << committed;
    }
  }
}

// Shared windows: the slots past the refill lag, less control frames (five
// per connection, at most a quarter), split evenly, at least one frame each.
TEST(ShareReceiveBudget, SplitsWhatTheSlotsHoldAmongTheConnections) {
  // The defaults: 512 slots, 16 of them refill lag, windows of 32.
  EXPECT_EQ(ShareReceiveBudget(32, 512, 16, 1).budget, 491u);
  EXPECT_EQ(ShareReceiveBudget(32, 512, 16, 1).window, 32u);
  EXPECT_EQ(ShareReceiveBudget(32, 512, 16, 13).window, 32u);
  EXPECT_EQ(ShareReceiveBudget(32, 512, 16, 14).window, 30u);  // the first to shrink
  EXPECT_EQ(ShareReceiveBudget(32, 512, 16, 15).window, 28u);  // 421 / 15
  EXPECT_EQ(ShareReceiveBudget(32, 512, 16, 17).budget, 411u);
  EXPECT_EQ(ShareReceiveBudget(32, 512, 16, 17).window, 24u);
  EXPECT_EQ(ShareReceiveBudget(32, 512, 16, 200).budget, 372u);  // the quarter caps control
  EXPECT_EQ(ShareReceiveBudget(32, 512, 16, 200).window, 1u);
  EXPECT_EQ(ShareReceiveBudget(32, 512, 16, 1000).window, 1u);  // never none
  // A client's response room is the budget: 64 slots, 8 of them lag.
  EXPECT_EQ(ShareReceiveBudget(1, 64, 8, 1).budget, 51u);
  EXPECT_EQ(ShareReceiveBudget(1, 64, 8, 2).budget, 46u);
  EXPECT_EQ(ShareReceiveBudget(1, 64, 8, 3).budget, 42u);  // the quarter caps control
  EXPECT_EQ(ShareReceiveBudget(1, 64, 8, 40).budget, 42u);
  EXPECT_EQ(ShareReceiveBudget(1, 64, 8, 0).budget, 51u);  // counted as one
  EXPECT_EQ(ShareReceiveBudget(8, 8, 8, 1).budget, 1u);    // the lag is the whole SRQ
  // While each gets more than one frame, the windows fit the budget.
  for (size_t n = 1; n < 600; ++n) {
    const ReceiveShare share = ShareReceiveBudget(32, 512, 16, n);
    if (share.window > 1) {
      EXPECT_LE(n * share.window, share.budget) << n;
    }
  }
}

TEST(CheckRdmaOptions, ListenAndConnectRefuseBadOptions) {
  RdmaOptions o;
  o.slot_size = 100;
  RdmaTransport server(TransportOptions{}, o, /*server=*/true);
  const auto listener =
      server.Listen(Address{"rdma", "127.0.0.1", 0},
                    [](std::shared_ptr<Connection>) -> ConnectionObserver* { return nullptr; });
  EXPECT_EQ(listener.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(listener.status().message().find("RDMARPC_RDMA_SLOT_SIZE"), std::string::npos)
      << listener.status().message();

  RdmaTransport client(TransportOptions{}, o, /*server=*/false);
  const auto conn =
      client.Connect(Address{"rdma", "127.0.0.1", 1}, nullptr, SteadyNow() + absl::Seconds(1));
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rdmarpc::transport::rdma
