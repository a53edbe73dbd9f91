#include "rpc/health.h"

#include "absl/strings/str_cat.h"
#include "rpc/internal/proto_method_name.h"

namespace rdmarpc {

using health::v1::HealthCheckRequest;
using health::v1::HealthCheckResponse;

HealthService::HealthService() {
  serving_[""] = true;
  auto check = [this](ServerContext*, const HealthCheckRequest* req, HealthCheckResponse* resp,
                      DoneCallback done) {
    StatusOr<ServingStatus> status = Check(req->service());
    if (status.ok()) resp->set_status(*status);
    std::move(done)(status.status());
  };
  AddMethod(internal::ProtoMethodName(*HealthCheckRequest::descriptor()->file(), "Health", "Check"),
            UnaryHandler<HealthCheckRequest, HealthCheckResponse>(check));
}

void HealthService::SetServingStatus(const std::string& service, bool serving) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!shut_down_) serving_[service] = serving;
}

void HealthService::SetServingStatus(bool serving) {
  std::lock_guard<std::mutex> lock(mu_);
  if (shut_down_) return;
  for (auto& [name, s] : serving_) s = serving;
}

void HealthService::Shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [name, s] : serving_) s = false;
  shut_down_ = true;
}

StatusOr<HealthService::ServingStatus> HealthService::Check(const std::string& service) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = serving_.find(service);
  if (it == serving_.end()) {
    return Status(StatusCode::kNotFound,
                  absl::StrCat("health: no service \"", service, "\" on this server"));
  }
  return it->second ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
}

}  // namespace rdmarpc
