// Duet's version (the CMake project's), for `duet --version` and GET /version.
#pragma once

namespace duet {

const char* DuetVersion();

}  // namespace duet
