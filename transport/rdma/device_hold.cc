#include "transport/rdma/device_hold.h"

#include <errno.h>
#include <rdma/rdma_cma.h>
#include <string.h>
#include <sys/stat.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace rdmarpc::transport::rdma {

absl::StatusOr<std::unique_ptr<DeviceHold>> DeviceHold::Take(ibv_context* verbs) {
  int count = 0;
  ibv_context** all = rdma_get_devices(&count);
  if (all == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("rdma_get_devices: ", strerror(errno ? errno : ENODEV)));
  }
  // Both lists are rdma_free_devices', which frees them with free().
  auto* mine = static_cast<ibv_context**>(calloc(2, sizeof(ibv_context*)));
  auto* others = static_cast<ibv_context**>(calloc(count + 1, sizeof(ibv_context*)));
  if (mine == nullptr || others == nullptr) {
    free(mine);
    free(others);
    rdma_free_devices(all);
    return absl::ResourceExhaustedError("out of memory for the device list");
  }
  int other = 0;
  for (int i = 0; i < count; ++i) {
    if (all[i] == verbs) {
      mine[0] = verbs;
    } else {
      others[other++] = all[i];
    }
  }
  free(all);
  rdma_free_devices(others);
  if (mine[0] == nullptr) {
    free(mine);
    return absl::UnavailableError(absl::StrCat("RDMA device ", ibv_get_device_name(verbs->device),
                                               " is no longer listed by librdmacm: it is "
                                               "being removed"));
  }
  struct stat node {};
  std::string uverbs_path = verbs->device->dev_path;
  if (stat(uverbs_path.c_str(), &node) != 0) uverbs_path.clear();
  return std::unique_ptr<DeviceHold>(new DeviceHold(mine, std::move(uverbs_path), node.st_ino));
}

DeviceHold::~DeviceHold() { rdma_free_devices(list_); }

bool DeviceHold::Removed() const {
  if (uverbs_path_.empty()) return false;
  struct stat node {};
  if (stat(uverbs_path_.c_str(), &node) == 0) return node.st_ino != uverbs_ino_;
  return errno == ENOENT;
}

}  // namespace rdmarpc::transport::rdma
