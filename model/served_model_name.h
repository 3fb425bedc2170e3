// The name a server reports for its model (the OpenAI API's "model", the metrics' model_name).
#pragma once

#include <string>

namespace duet {

// `served_model_name` (--served-model-name) when given, else the model directory's base name
// ("models/tiny/" → "tiny").
std::string ServedModelName(const std::string& served_model_name, const std::string& model_dir);

}  // namespace duet
