// Process-wide switch for programmatic dependent launch (kernels/launch.cuh) of Duet's kernels.
#pragma once

namespace duet::kernels {

// On by default. Off makes every kernel launch an ordinary, fully serialized one (for comparison
// and for debugging); takes effect for launches (and graph captures) made afterwards.
void SetProgrammaticLaunch(bool enabled);
bool ProgrammaticLaunchEnabled();

}  // namespace duet::kernels
