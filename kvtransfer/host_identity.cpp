#include "kvtransfer/host_identity.h"

#include <unistd.h>

#include <fstream>

namespace duet::kvtransfer {

std::string LocalHostIdentity() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) name[0] = '\0';
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  return std::string(name) + "/" + boot_id;
}

}  // namespace duet::kvtransfer
