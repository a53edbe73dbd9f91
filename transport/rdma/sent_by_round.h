// SentByRound: how much of something we sent a peer (credits, answers to
// its kShrink asks) went out before a given poll round
// (Endpoint::poll_round), for the checks that a peer sends only what it may.
//
//   SentByRound credits;
//   credits.Add(endpoint->poll_round(), 4);  // as a frame carrying 4 is queued
//   ...
//   // handling a frame polled in round r: what can have reached the peer
//   const int64_t before = credits.total() - credits.InRound(r);
//
// Why rounds: a frame polled in round r was sent by the peer before the
// poll, so it can answer only what we queued before the round began; what
// we queued while handling the frames of round r (or not yet) cannot have
// reached it. Only the latest round is kept apart: a round read stale
// (older than the latest noted) counts its part as sent before, which lets
// a check miss, never blame an honest peer. Not thread-safe: its owner's
// lock guards it.
#ifndef RDMARPC_TRANSPORT_RDMA_SENT_BY_ROUND_H_
#define RDMARPC_TRANSPORT_RDMA_SENT_BY_ROUND_H_

#include <cstdint>

namespace rdmarpc::transport::rdma {

class SentByRound {
 public:
  // `count` more was queued for the peer while `round` was the latest.
  void Add(uint64_t round, int64_t count) {
    if (round > round_) {
      round_ = round;
      in_round_ = 0;
    }
    if (round == round_) in_round_ += count;
    total_ += count;
  }
  // What was queued while `round` was the latest (0 for any other).
  int64_t InRound(uint64_t round) const { return round == round_ ? in_round_ : 0; }
  // What was queued, in all.
  int64_t total() const { return total_; }

 private:
  uint64_t round_ = 0;
  int64_t in_round_ = 0;
  int64_t total_ = 0;
};

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_SENT_BY_ROUND_H_
