#include "bench/serving/dataset.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include "gtest/gtest.h"

namespace duet::bench {
namespace {

namespace fs = std::filesystem;

class DatasetTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto tokenizer = Tokenizer::FromModelDir(std::string(DUET_MODELS_DIR) + "/tiny-code-llama");
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = std::move(*tokenizer).release();
  }
  static void TearDownTestSuite() { delete tokenizer_; }

  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("duet_bench_dataset_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& text) {
    const fs::path path = dir_ / name;
    fs::create_directories(path.parent_path());
    std::ofstream(path) << text;
    return path.string();
  }
  DatasetOptions Options(DatasetKind kind) {
    DatasetOptions o;
    o.kind = kind;
    o.tokenizer = tokenizer_;
    o.num_prompts = 6;
    o.input_len = 24;
    o.output_len = 8;
    o.seed = 5;
    return o;
  }
  static std::string Error(const absl::StatusOr<std::vector<BenchRequest>>& r) {
    return r.ok() ? "ok" : std::string(r.status().message());
  }

  static const Tokenizer* tokenizer_;
  fs::path dir_;
};
const Tokenizer* DatasetTest::tokenizer_ = nullptr;

TEST_F(DatasetTest, RandomPromptsHaveExactTokenLengths) {
  DatasetOptions o = Options(DatasetKind::kRandom);
  o.num_prompts = 40;
  o.input_len = 100;
  auto requests = LoadDataset(o);
  ASSERT_TRUE(requests.ok()) << requests.status();
  ASSERT_EQ(requests->size(), 40u);
  std::set<std::string> distinct;
  for (const BenchRequest& r : *requests) {
    EXPECT_EQ(r.prompt_tokens, 100);
    EXPECT_EQ(tokenizer_->Encode(r.prompt).size(), 100u);
    EXPECT_EQ(r.output_tokens, 8);
    distinct.insert(r.prompt);
  }
  EXPECT_EQ(distinct.size(), 40u);
}

TEST_F(DatasetTest, RandomLengthsStayInTheRangeAndFollowTheSeed) {
  DatasetOptions o = Options(DatasetKind::kRandom);
  o.num_prompts = 30;
  o.input_len = 40;
  o.output_len = 20;
  o.range_ratio = 0.5;
  auto a = LoadDataset(o);
  auto b = LoadDataset(o);
  ASSERT_TRUE(a.ok() && b.ok());
  std::set<int> input_lengths;
  for (size_t i = 0; i < a->size(); ++i) {
    const BenchRequest& r = (*a)[i];
    EXPECT_GE(r.prompt_tokens, 20);
    EXPECT_LE(r.prompt_tokens, 60);
    EXPECT_GE(r.output_tokens, 10);
    EXPECT_LE(r.output_tokens, 30);
    input_lengths.insert(r.prompt_tokens);
    EXPECT_EQ(r.prompt, (*b)[i].prompt);
  }
  EXPECT_GT(input_lengths.size(), 5u);
  o.seed = 6;
  auto c = LoadDataset(o);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(a->front().prompt, c->front().prompt);
}

// A smaller run of the same seed sends the first requests of a larger one (scripts/gpu/
// h200_cluster.sh runs the engine alone on --save-requests of one size, the cluster on others).
TEST_F(DatasetTest, RandomRunsOfFewerPromptsAreTheFirstOfMore) {
  DatasetOptions o = Options(DatasetKind::kRandom);
  o.range_ratio = 0.3;
  o.num_prompts = 25;
  auto more = LoadDataset(o);
  o.num_prompts = 7;
  auto fewer = LoadDataset(o);
  ASSERT_TRUE(more.ok() && fewer.ok());
  for (size_t i = 0; i < fewer->size(); ++i) {
    EXPECT_EQ((*fewer)[i].prompt, (*more)[i].prompt) << i;
    EXPECT_EQ((*fewer)[i].output_tokens, (*more)[i].output_tokens) << i;
  }
}

TEST_F(DatasetTest, TokenizerIsNeededWhereLengthsAreInTokens) {
  for (DatasetKind kind : {DatasetKind::kRandom, DatasetKind::kSharedPrefix, DatasetKind::kCode}) {
    DatasetOptions o = Options(kind);
    o.tokenizer = nullptr;
    EXPECT_NE(Error(LoadDataset(o)).find("--tokenizer"), std::string::npos);
  }
}

TEST_F(DatasetTest, SharedPrefixGroupsShareTheirSystemPrompt) {
  DatasetOptions o = Options(DatasetKind::kSharedPrefix);
  o.num_prompts = 12;
  o.prefix_len = 64;
  o.num_prefix_groups = 3;
  auto requests = LoadDataset(o);
  ASSERT_TRUE(requests.ok()) << requests.status();
  ASSERT_EQ(requests->size(), 12u);
  std::map<std::string, int> by_prefix;
  for (const BenchRequest& r : *requests) {
    const size_t cut = r.prompt.find("\n\n");
    ASSERT_NE(cut, std::string::npos);
    ++by_prefix[r.prompt.substr(0, cut)];
    EXPECT_GE(r.prompt_tokens, 64 + 24);
  }
  ASSERT_EQ(by_prefix.size(), 3u);
  for (const auto& [prefix, count] : by_prefix) EXPECT_EQ(count, 4);
}

TEST_F(DatasetTest, MultiTurnSessionsShareSystemPromptsByGroup) {
  DatasetOptions o = Options(DatasetKind::kMultiTurn);
  o.num_sessions = 6;
  o.num_turns = 3;
  o.prefix_len = 48;
  o.num_prefix_groups = 2;
  auto sessions = LoadChatSessions(o);
  ASSERT_TRUE(sessions.ok()) << sessions.status();
  ASSERT_EQ(sessions->size(), 6u);
  std::set<std::string> system_prompts, messages;
  for (size_t s = 0; s < sessions->size(); ++s) {
    const ChatSession& session = (*sessions)[s];
    EXPECT_EQ(session.system_prompt, (*sessions)[s % 2].system_prompt) << s;
    EXPECT_EQ(tokenizer_->Encode(session.system_prompt).size(), 48u);
    system_prompts.insert(session.system_prompt);
    ASSERT_EQ(session.user_messages.size(), 3u);
    EXPECT_EQ(session.output_tokens, std::vector<int>(3, 8));
    for (const std::string& m : session.user_messages) {
      EXPECT_EQ(tokenizer_->Encode(m).size(), 24u);
      messages.insert(m);
    }
  }
  EXPECT_EQ(system_prompts.size(), 2u);
  EXPECT_EQ(messages.size(), 18u);
  auto again = LoadChatSessions(o);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->back().user_messages, sessions->back().user_messages);  // the seed decides
  EXPECT_NE(Error(LoadDataset(o)).find("LoadChatSessions"), std::string::npos);
  o.num_turns = 0;
  EXPECT_FALSE(LoadChatSessions(o).ok());
  o.num_turns = 2;
  o.tokenizer = nullptr;
  EXPECT_FALSE(LoadChatSessions(o).ok());
}

// Turn k's prompt is turn k-1's prompt, its answer and the next message, so a prefix cache (and
// the router's prefix index) finds the earlier turn's tokens at its start.
TEST_F(DatasetTest, AChatTurnExtendsThePreviousTurnAndItsAnswer) {
  DatasetOptions o = Options(DatasetKind::kMultiTurn);
  o.num_sessions = 1;
  o.num_turns = 3;
  o.prefix_len = 40;
  auto sessions = LoadChatSessions(o);
  ASSERT_TRUE(sessions.ok()) << sessions.status();
  const ChatSession& session = sessions->front();
  const std::vector<std::string> answers = {" return x + 1", "\n    pass"};
  const std::string first = ChatPrompt(session, {});
  const std::string second = ChatPrompt(session, {answers[0]});
  const std::string third = ChatPrompt(session, answers);
  EXPECT_EQ(first, session.system_prompt + "\n\nUser: " + session.user_messages[0] + "\n\nAssistant:");
  EXPECT_EQ(second.rfind(first + answers[0], 0), 0u);
  EXPECT_EQ(third.rfind(second + answers[1], 0), 0u);
  EXPECT_NE(third.find(session.user_messages[2]), std::string::npos);
  // In tokens too: all of the shorter prompt's tokens but the last start the longer one.
  const std::vector<int32_t> a = tokenizer_->Encode(second), b = tokenizer_->Encode(third);
  ASSERT_LT(a.size(), b.size());
  EXPECT_TRUE(std::equal(a.begin(), a.end() - 1, b.begin()));

  const std::vector<ChatMessage> chat = ChatMessages(session, {answers[0]});
  ASSERT_EQ(chat.size(), 4u);
  EXPECT_EQ(chat[0].role, "system");
  EXPECT_EQ(chat[0].content, session.system_prompt);
  EXPECT_EQ(chat[1].role, "user");
  EXPECT_EQ(chat[1].content, session.user_messages[0]);
  EXPECT_EQ(chat[2].role, "assistant");
  EXPECT_EQ(chat[2].content, answers[0]);
  EXPECT_EQ(chat[3].role, "user");
  EXPECT_EQ(chat[3].content, session.user_messages[1]);
}

TEST_F(DatasetTest, JsonlReadsPromptsAndLengthsAndCycles) {
  DatasetOptions o = Options(DatasetKind::kJsonl);
  o.path = Write("p.jsonl", "{\"prompt\": \"def add(a, b):\", \"output_len\": 5}\n\n{\"prompt\": \"import os\"}\n"
                            "{\"prompt\": \"class A:\", \"max_tokens\": 7}\n");
  o.num_prompts = 4;
  auto requests = LoadDataset(o);
  ASSERT_TRUE(requests.ok()) << requests.status();
  ASSERT_EQ(requests->size(), 4u);
  EXPECT_EQ((*requests)[0].prompt, "def add(a, b):");
  EXPECT_EQ((*requests)[0].output_tokens, 5);
  EXPECT_EQ((*requests)[1].output_tokens, 8);  // --output-len
  EXPECT_EQ((*requests)[2].output_tokens, 7);
  EXPECT_EQ((*requests)[3].prompt, "def add(a, b):");
  EXPECT_EQ((*requests)[0].prompt_tokens, int(tokenizer_->Encode("def add(a, b):").size()));
  o.fixed_output_len = true;
  requests = LoadDataset(o);
  ASSERT_TRUE(requests.ok());
  EXPECT_EQ((*requests)[0].output_tokens, 8);
  o.tokenizer = nullptr;  // optional here
  EXPECT_TRUE(LoadDataset(o).ok());
}

TEST_F(DatasetTest, JsonlErrorsNameTheLine) {
  DatasetOptions o = Options(DatasetKind::kJsonl);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"prompt\": \"a\"}\n{\"prompt\": \"b\"\n", ":2: not valid JSON"},
      {"[1, 2]\n", ":1: expected a JSON object"},
      {"{\"text\": \"a\"}\n", ":1: \"prompt\" must be a non-empty string"},
      {"{\"prompt\": \"\"}\n", ":1: \"prompt\" must be a non-empty string"},
      {"{\"prompt\": \"a\", \"output_len\": 0}\n", ":1: \"output_len\" must be a positive integer"},
      {"{\"prompt\": \"a\", \"max_tokens\": \"9\"}\n", "\"max_tokens\" must be a positive integer"},
      {"\n\n", "no prompts"},
  };
  for (const auto& [text, expected] : cases) {
    o.path = Write("bad.jsonl", text);
    EXPECT_NE(Error(LoadDataset(o)).find(expected), std::string::npos) << text << " -> " << Error(LoadDataset(o));
  }
  o.path = (dir_ / "missing.jsonl").string();
  EXPECT_NE(Error(LoadDataset(o)).find("cannot read"), std::string::npos);
  o.path.clear();
  EXPECT_NE(Error(LoadDataset(o)).find("--dataset-path"), std::string::npos);
}

TEST_F(DatasetTest, ShareGptTakesTheFirstTurnAndTheReplyLength) {
  const std::string reply = "Here is a function that adds two numbers and returns their sum to the caller.";
  DatasetOptions o = Options(DatasetKind::kShareGpt);
  o.path = Write("sharegpt.json", R"([
    {"id": "a", "conversations": [{"from": "human", "value": "Write a Python function that adds two numbers."},
                                  {"from": "gpt", "value": ")" + reply + R"("}]},
    {"id": "short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    {"id": "one-turn", "conversations": [{"from": "human", "value": "Only a question, no answer here."}]}
  ])");
  o.num_prompts = 3;
  auto requests = LoadDataset(o);
  ASSERT_TRUE(requests.ok()) << requests.status();
  ASSERT_EQ(requests->size(), 3u);  // the one usable conversation, cycled
  for (const BenchRequest& r : *requests) {
    EXPECT_EQ(r.prompt, "Write a Python function that adds two numbers.");
    EXPECT_EQ(r.output_tokens, int(tokenizer_->Encode(reply).size()));
  }
  o.fixed_output_len = true;
  requests = LoadDataset(o);
  ASSERT_TRUE(requests.ok());
  EXPECT_EQ(requests->front().output_tokens, 8);
}

TEST_F(DatasetTest, ShareGptErrors) {
  DatasetOptions o = Options(DatasetKind::kShareGpt);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"conversations\": []}", "a JSON array of conversations"},
      {"[{\"conversations\": [}", "not valid JSON"},
      {"[{\"id\": 1}]", "entry 0: expected {\"conversations\": [...]}"},
      {"[{\"conversations\": [{\"from\": \"human\", \"value\": \"question\"}, {\"from\": \"gpt\"}]}]", "turn 1 needs a string"},
      {"[{\"conversations\": [{\"value\": \"a\"}, {\"value\": \"b\"}]}]", "no usable conversations"},
  };
  for (const auto& [text, expected] : cases) {
    o.path = Write("bad.json", text);
    EXPECT_NE(Error(LoadDataset(o)).find(expected), std::string::npos) << text << " -> " << Error(LoadDataset(o));
  }
  o.path = Write("ok.json", "[]");
  o.tokenizer = nullptr;
  EXPECT_NE(Error(LoadDataset(o)).find("--tokenizer"), std::string::npos);
}

TEST_F(DatasetTest, CodeCutsSourceFilesIntoPrompts) {
  std::string source;
  for (int i = 0; i < 40; ++i) source += "def f" + std::to_string(i) + "(x):\n    return x * " + std::to_string(i) + "\n\n";
  Write("src/pkg/module.py", source);
  Write("src/.git/objects.py", "should never be read " + source);
  Write("src/notes.txt", "not source");
  Write("src/tiny.py", "x = 1\n");  // too short to cut
  DatasetOptions o = Options(DatasetKind::kCode);
  o.code_dir = (dir_ / "src").string();
  o.num_prompts = 10;
  o.input_len = 32;
  auto requests = LoadDataset(o);
  ASSERT_TRUE(requests.ok()) << requests.status();
  ASSERT_EQ(requests->size(), 10u);
  for (const BenchRequest& r : *requests) {
    EXPECT_NE(source.find(r.prompt), std::string::npos) << r.prompt;
    EXPECT_NEAR(r.prompt_tokens, 32, 2);
    EXPECT_EQ(r.output_tokens, 8);
  }
}

TEST_F(DatasetTest, CodeErrors) {
  DatasetOptions o = Options(DatasetKind::kCode);
  EXPECT_NE(Error(LoadDataset(o)).find("--code-dir"), std::string::npos);
  o.code_dir = (dir_ / "nowhere").string();
  EXPECT_NE(Error(LoadDataset(o)).find("is not a directory"), std::string::npos);
  Write("empty/readme.md", "no code here");
  Write("empty/tiny.py", "x = 1\n");
  o.code_dir = (dir_ / "empty").string();
  EXPECT_NE(Error(LoadDataset(o)).find("no source files"), std::string::npos);
}

TEST_F(DatasetTest, BadSettings) {
  DatasetOptions o = Options(DatasetKind::kRandom);
  o.num_prompts = 0;
  EXPECT_FALSE(LoadDataset(o).ok());
  o = Options(DatasetKind::kRandom);
  o.range_ratio = 1;
  EXPECT_FALSE(LoadDataset(o).ok());
  EXPECT_FALSE(ParseDatasetKind("imagenet").ok());
  EXPECT_EQ(*ParseDatasetKind("shared-prefix"), DatasetKind::kSharedPrefix);
}

}  // namespace
}  // namespace duet::bench
