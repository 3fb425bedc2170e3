#include "kernels/launch.h"

#include <atomic>

namespace duet::kernels {
namespace {

std::atomic<bool> programmatic_launch{true};

}  // namespace

void SetProgrammaticLaunch(bool enabled) { programmatic_launch.store(enabled, std::memory_order_relaxed); }

bool ProgrammaticLaunchEnabled() { return programmatic_launch.load(std::memory_order_relaxed); }

}  // namespace duet::kernels
