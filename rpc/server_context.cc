#include "rpc/server_context.h"

#include <utility>

#include "rpc/internal/payload.h"
#include "rpc/internal/user_code.h"

namespace rdmarpc {

absl::StatusOr<Attachment> ServerContext::AllocateResponseAttachment(size_t size,
                                                                     size_t message_room) {
  auto bytes = internal::AttachmentMemorySize(size, message_room, max_message_size_);
  if (!bytes.ok()) return bytes.status();
  auto memory = conn_.AllocatePayload(*bytes);
  if (!memory.ok()) return memory.status();
  return Attachment(std::move(*memory), size);
}

void ServerContext::OnCancel(absl::AnyInvocable<void() &&> on_cancel) {
  bool run_now = false;
  bool watch = false;
  absl::AnyInvocable<void() &&> replaced;  // destroyed outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Set before answered_ is read, as MarkAnswered sets answered_ before it
    // reads this: one of the two sees the other, so a callback registered
    // while the call is answered is dropped by one side or the other.
    has_on_cancel_.store(true);
    if (answered_.load()) return;
    if (IsCancelled()) {
      run_now = true;
    } else {
      replaced = std::exchange(on_cancel_, std::move(on_cancel));
      watch =
          deadline_ != absl::InfiniteFuture() && deadline_watch_ != nullptr && !deadline_watched_;
      deadline_watched_ = deadline_watched_ || watch;
    }
  }
  if (run_now) std::move(on_cancel)();
  if (watch) deadline_watch_(watch_owner_);
}

void ServerContext::MarkCancelled() {
  cancelled_.store(true);
  std::shared_ptr<internal::CallTree> tree;
  absl::AnyInvocable<void() &&> on_cancel;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tree = call_tree_;
    on_cancel = std::exchange(on_cancel_, nullptr);
  }
  if (tree) tree->CancelAll();
  // On the thread that saw the cancellation (I/O, timer, Shutdown's), where
  // a throw would end the process.
  if (on_cancel)
    internal::RunUserCode("an OnCancel callback", method_, [&] { std::move(on_cancel)(); });
}

void ServerContext::DropOnCancel() {
  absl::AnyInvocable<void() &&> dropped;  // destroyed outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  dropped = std::exchange(on_cancel_, nullptr);
}

}  // namespace rdmarpc
