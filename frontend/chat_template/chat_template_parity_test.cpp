// Byte-for-byte parity with @huggingface/jinja: tests/chat_template_parity/expected holds what
// the reference rendered for every (template, conversation) pair (render_reference.mjs), so this
// test needs no node. Also: malformed templates (mutations of the real ones) never crash or hang.
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "frontend/chat_template/chat_template.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace duet {
namespace {

const std::string kParityDir = std::string(DUET_SOURCE_DIR) + "/tests/chat_template_parity";

std::string ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

nlohmann::ordered_json ReadJson(const std::string& path) { return nlohmann::ordered_json::parse(ReadFile(path)); }

// Mirrors contextFor() in render_reference.mjs.
nlohmann::ordered_json ContextFor(const nlohmann::ordered_json& entry, const nlohmann::ordered_json& conversation) {
  nlohmann::ordered_json context = {
      {"messages", conversation["messages"]},
      {"add_generation_prompt", conversation["add_generation_prompt"]},
      {"bos_token", entry["bos_token"]},
      {"eos_token", entry["eos_token"]},
      {"date_string", "26 Jul 2024"},
  };
  if (conversation.contains("tools")) context["tools"] = conversation["tools"];
  if (conversation.contains("enable_thinking")) context["enable_thinking"] = conversation["enable_thinking"];
  return context;
}

class ChatTemplateParityTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ChatTemplateParityTest, MatchesHuggingFaceJinja) {
  nlohmann::ordered_json entry;
  for (const auto& candidate : ReadJson(kParityDir + "/templates/index.json")) {
    if (candidate["name"] == GetParam()) entry = candidate;
  }
  ASSERT_FALSE(entry.is_null()) << GetParam();
  absl::StatusOr<ChatTemplate> chat_template =
      ChatTemplate::Parse(ReadFile(kParityDir + "/templates/" + entry["file"].get<std::string>()));
  ASSERT_TRUE(chat_template.ok()) << chat_template.status();

  nlohmann::ordered_json conversations = ReadJson(kParityDir + "/conversations.json");
  std::ifstream expected_file(kParityDir + "/expected/" + GetParam() + ".jsonl");
  std::string line;
  size_t index = 0, compared = 0;
  while (std::getline(expected_file, line)) {
    if (line.empty()) continue;
    auto expected = nlohmann::ordered_json::parse(line);
    ASSERT_LT(index, conversations.size());
    const auto& conversation = conversations[index++];
    ASSERT_EQ(expected["case"], conversation["name"]);
    absl::StatusOr<std::string> rendered = chat_template->Render(ContextFor(entry, conversation));
    std::string name = conversation["name"];
    if (expected.contains("error")) {
      EXPECT_FALSE(rendered.ok()) << name << " rendered although the reference failed: "
                                  << expected["error"].get<std::string>();
      if (!rendered.ok()) {
        EXPECT_EQ(std::string(rendered.status().message()), expected["error"].get<std::string>()) << name;
      }
    } else {
      ASSERT_TRUE(rendered.ok()) << name << ": " << rendered.status();
      EXPECT_EQ(*rendered, expected["output"].get<std::string>()) << name;
    }
    ++compared;
  }
  EXPECT_EQ(compared, conversations.size()) << "expected/" << GetParam() << ".jsonl is stale";
}

INSTANTIATE_TEST_SUITE_P(ChatTemplate, ChatTemplateParityTest,
                         ::testing::Values("llama3", "qwen3", "llama3_1_tools", "mistral", "features", "fallback"));

TEST(ChatTemplateParity, FallbackCopyMatchesHeader) {
  EXPECT_EQ(ReadFile(kParityDir + "/templates/fallback.jinja"), kFallbackChatTemplate);
}

// Random byte edits, deletions and duplications of real templates: every result is a status or a
// string, within the evaluator's budget (a hang fails by timeout, a crash kills the binary).
TEST(ChatTemplateParity, MutatedTemplatesNeverCrash) {
  const std::string alphabet = "{}%#-+*/|.,:()[]'\"\\ \nabcdefxyz0123456789=<>!~";
  nlohmann::ordered_json conversations = ReadJson(kParityDir + "/conversations.json");
  nlohmann::ordered_json entries = ReadJson(kParityDir + "/templates/index.json");
  std::mt19937 rng(20240726);
  int parsed = 0, rendered = 0;
  for (int iteration = 0; iteration < 3000; ++iteration) {
    const auto& entry = entries[iteration % entries.size()];
    std::string source = ReadFile(kParityDir + "/templates/" + entry["file"].get<std::string>());
    int edits = 1 + rng() % 4;
    for (int e = 0; e < edits && !source.empty(); ++e) {
      size_t pos = rng() % source.size();
      switch (rng() % 4) {
        case 0: source[pos] = alphabet[rng() % alphabet.size()]; break;
        case 1: source.erase(pos, 1 + rng() % 8); break;
        case 2: source.insert(pos, source.substr(rng() % source.size(), 1 + rng() % 40)); break;
        case 3: source.insert(pos, 1, alphabet[rng() % alphabet.size()]); break;
      }
    }
    absl::StatusOr<ChatTemplate> chat_template = ChatTemplate::Parse(source);
    if (!chat_template.ok()) {
      EXPECT_EQ(chat_template.status().code(), absl::StatusCode::kInvalidArgument);
      continue;
    }
    ++parsed;
    const auto& conversation = conversations[iteration % conversations.size()];
    absl::StatusOr<std::string> output = chat_template->Render(ContextFor(entry, conversation));
    if (output.ok()) ++rendered;
  }
  EXPECT_GT(parsed, 0);
  EXPECT_GT(rendered, 0);
}

}  // namespace
}  // namespace duet
