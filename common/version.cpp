#include "common/version.h"

namespace duet {

const char* DuetVersion() { return DUET_VERSION; }

}  // namespace duet
