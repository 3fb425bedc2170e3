// libFuzzer entry point for what the router parses from clients and peers. The first input byte
// picks the parser, the rest is its input:
//   0 POST /v1/completions body     1 POST /v1/chat/completions body (the model's chat template)
//   2 POST /tokenize body           3 POST /detokenize body
//   4 HTTP/1.x request bytes (Beast's parser with the HTTP server's limits)
//   5 KV layout descriptor (kvtransfer::KvLayout::Deserialize)
//   6 tokenizer.json (loaded, then encodes and decodes a sample)
//   7 chat template source (parsed, then rendered with a conversation)
//   8 model output through each tool-call parser (router/openai_tool_calls.h), whole and streamed
//   9 a KV receiver descriptor from a decode worker (kvtransfer::ReceiverDescriptor::Parse)
//  10 a KV transfer notice from a prefill worker (kvtransfer::Notice::Parse)
//  11 a worker's reply to the router: a PrefillResponse or a decode stream's GenerateResponse
//     (first byte even / odd; the next two: the prompt length and prompt logprobs asked for),
//     through the router's checks (router/worker_replies.h)
// Whatever the bytes, a parser must return a status, never crash, and what it accepts must
// satisfy the invariants checked below.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <boost/beast/core/buffers_to_string.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>

#include "common/check.h"
#include "frontend/chat_template/chat_template.h"
#include "frontend/tokenizer/tokenizer.h"
#include "kvtransfer/kv_layout.h"
#include "kvtransfer/ucx_protocol.h"
#include "nlohmann/json.hpp"
#include "router/openai_protocol.h"
#include "router/worker_replies.h"
#include "tests/fuzz/mutation_driver.h"

namespace duet {
namespace {

namespace http = boost::beast::http;
using router::openai::Json;

constexpr int kTargets = 12;
// $DUET_MODELS_DIR (a run away from the checkout, e.g. on another machine) or the checkout's.
const std::string kModelDir =
    std::string(std::getenv("DUET_MODELS_DIR") != nullptr ? std::getenv("DUET_MODELS_DIR") : DUET_MODELS_DIR) +
    "/tiny-code-llama";

struct Model {
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<LoadedChatTemplate> chat;
  router::openai::ProtocolContext context;
};

const Model& TheModel() {
  static const Model* model = [] {
    auto* m = new Model();
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromModelDir(kModelDir);
    DUET_CHECK_MSG(tokenizer.ok(), "the fuzz model's tokenizer");
    m->tokenizer = *std::move(tokenizer);
    absl::StatusOr<LoadedChatTemplate> chat = LoadChatTemplate(kModelDir);
    DUET_CHECK_MSG(chat.ok(), "the fuzz model's chat template");
    m->chat = std::make_unique<LoadedChatTemplate>(*std::move(chat));
    m->context.model_name = "tiny-code-llama";
    m->context.tokenizer = m->tokenizer.get();
    m->context.chat = m->chat.get();
    m->context.max_model_len = 2048;
    m->context.auto_tool_call_format = router::openai::ToolCallFormat::kHermes;
    return m;
  }();
  return *model;
}

void CheckError(const absl::Status& status) {
  DUET_CHECK(!status.ok() && !status.message().empty());
  const router::openai::ApiError error = router::openai::ToApiError(status);
  DUET_CHECK(error.status >= 400 && error.status < 600);
  DUET_CHECK(Json::parse(router::openai::ErrorBody(error), nullptr, /*allow_exceptions=*/false).is_object());
}

void CheckRequest(const std::string& body, bool chat) {
  const Model& model = TheModel();
  absl::StatusOr<router::openai::ParsedRequest> parsed = chat
                                                             ? router::openai::ParseChatRequest(body, model.context)
                                                             : router::openai::ParseCompletionRequest(body, model.context);
  if (!parsed.ok()) return CheckError(parsed.status());
  DUET_CHECK(!parsed->prompts.empty() && parsed->n >= 1 && parsed->chat == chat);
  for (const router::openai::PromptInput& prompt : parsed->prompts) {
    // Chat: the rendered conversation's token ids. Completions' token ids are checked against
    // the vocabulary by the router service.
    if (chat) {
      DUET_CHECK(!prompt.is_text && !prompt.token_ids.empty());
      for (int32_t id : prompt.token_ids) DUET_CHECK(id >= 0 && id < model.tokenizer->vocab_size());
    }
  }
}

void CheckTokenize(const std::string& body, bool tokenize) {
  const Model& model = TheModel();
  absl::StatusOr<Json> out = tokenize ? router::openai::Tokenize(body, model.context)
                                      : router::openai::Detokenize(body, model.context);
  if (!out.ok()) return CheckError(out.status());
  if (tokenize) {
    DUET_CHECK((*out)["count"].get<size_t>() == (*out)["tokens"].size());
  } else {
    DUET_CHECK((*out)["prompt"].is_string());
  }
  (void)out->dump(-1, ' ', false, Json::error_handler_t::replace);
}

// As router/http_server.cpp reads a request: header limit, body limit, bytes as they come.
void CheckHttpRequest(const std::string& bytes) {
  constexpr size_t kBodyLimit = 1 << 16;
  size_t offset = 0;
  while (offset < bytes.size()) {
    http::request_parser<http::string_body> parser;
    parser.header_limit(1 << 14);
    parser.body_limit(kBodyLimit);
    parser.eager(true);
    boost::system::error_code ec;
    while (offset < bytes.size() && !parser.is_done() && !ec) {
      // Fed in pieces of up to 7 bytes, like a slow client.
      const size_t piece = std::min<size_t>(bytes.size() - offset, 1 + (bytes[offset] & 7));
      offset += parser.put(boost::asio::buffer(bytes.data() + offset, piece), ec);
      if (ec == http::error::need_more) {
        ec = {};
        // A piece too short to make progress: give it the rest.
        if (offset < bytes.size()) {
          offset += parser.put(boost::asio::buffer(bytes.data() + offset, bytes.size() - offset), ec);
          if (ec == http::error::need_more) return;
        }
      }
    }
    if (ec || !parser.is_done()) return;
    const http::request<http::string_body>& message = parser.get();
    DUET_CHECK(message.body().size() <= kBodyLimit);
    (void)std::string(message.target());
    (void)message.keep_alive();
    (void)message.version();
  }
}

void CheckKvLayout(const std::string& bytes) {
  absl::StatusOr<kvtransfer::KvLayout> layout = kvtransfer::KvLayout::Deserialize(bytes);
  if (!layout.ok()) {
    DUET_CHECK(!layout.status().message().empty());
    return;
  }
  DUET_CHECK(layout->Validate().ok());
  absl::StatusOr<kvtransfer::KvLayout> again = kvtransfer::KvLayout::Deserialize(layout->Serialize());
  DUET_CHECK(again.ok() && *again == *layout);
  absl::StatusOr<kvtransfer::LayoutMatch> match = kvtransfer::CheckCompatible(*layout, *layout);
  DUET_CHECK(match.ok() && *match == kvtransfer::LayoutMatch::kSameShape);
  (void)layout->DebugString();
}

// What a prefill worker accepts as a decode worker's descriptor is self-consistent: a valid
// layout, one region per pool, and it serializes back to a blob that parses to the same.
void CheckReceiverDescriptor(const std::string& blob) {
  absl::StatusOr<kvtransfer::ReceiverDescriptor> d = kvtransfer::ReceiverDescriptor::Parse(blob);
  if (!d.ok()) {
    DUET_CHECK(!d.status().message().empty());
    return;
  }
  DUET_CHECK(d->layout.Validate().ok());
  DUET_CHECK(d->regions.size() == 2 * size_t{d->layout.num_layers});
  const std::string again = d->Serialize();
  absl::StatusOr<kvtransfer::ReceiverDescriptor> reparsed = kvtransfer::ReceiverDescriptor::Parse(again);
  DUET_CHECK(reparsed.ok() && reparsed->Serialize() == again);
}

// A notice the receiver accepts has its magic, version and a known type.
void CheckNotice(const std::string& bytes) {
  absl::StatusOr<kvtransfer::Notice> n = kvtransfer::Notice::Parse(bytes.data(), bytes.size());
  if (!n.ok()) {
    DUET_CHECK(!n.status().message().empty());
    return;
  }
  DUET_CHECK(n->magic == kvtransfer::Notice::kMagic && n->version == kvtransfer::Notice::kVersion);
  DUET_CHECK(n->type == kvtransfer::NoticeType::kLayerDone || n->type == kvtransfer::NoticeType::kFinish ||
             n->type == kvtransfer::NoticeType::kAbort);
}

// What the router relays from a worker stays inside the vocabulary and consistent: token ids,
// every top-logprob id, logprob counts, a finish reason it knows, prompt logprobs as asked.
void CheckWorkerReply(const std::string& bytes) {
  constexpr int64_t kVocab = 8192;
  if (bytes.size() < 3) return;
  const int64_t prompt_len = 1 + uint8_t(bytes[1]);
  const int32_t asked = int32_t(uint8_t(bytes[2]) % 22) - 1;  // -1 (none) .. 20
  const std::string message = bytes.substr(3);
  auto in_vocab = [](int32_t id) { return id >= 0 && id < kVocab; };
  if (uint8_t(bytes[0]) % 2 == 0) {
    v1::PrefillResponse reply;
    if (!reply.ParseFromString(message)) return;
    if (!router::InvalidPrefillReply(reply, prompt_len, asked, kVocab).empty()) return;
    DUET_CHECK(in_vocab(reply.first_token_id()));
    for (const v1::TopLogprob& top : reply.first_token_logprobs().top()) DUET_CHECK(in_vocab(top.token_id()));
    DUET_CHECK(asked >= 0 ? reply.prompt_logprobs_size() == prompt_len - 1 : reply.prompt_logprobs_size() == 0);
    for (const v1::TokenLogprobs& lp : reply.prompt_logprobs()) {
      DUET_CHECK(lp.top_size() == asked && lp.rank() >= 1 && lp.rank() <= kVocab);
      for (const v1::TopLogprob& top : lp.top()) DUET_CHECK(in_vocab(top.token_id()));
    }
    return;
  }
  v1::GenerateResponse out;
  if (!out.ParseFromString(message)) return;
  DUET_CHECK(!router::InvalidDecodeMessage(out, kVocab, /*finished_before=*/true).empty());
  if (!router::InvalidDecodeMessage(out, kVocab, /*finished_before=*/false).empty()) return;
  for (int32_t id : out.token_ids()) DUET_CHECK(in_vocab(id));
  DUET_CHECK(out.logprobs_size() == 0 || out.logprobs_size() == out.token_ids_size());
  for (const v1::TokenLogprobs& lp : out.logprobs()) {
    for (const v1::TopLogprob& top : lp.top()) DUET_CHECK(in_vocab(top.token_id()));
  }
  DUET_CHECK(out.prompt_logprobs_size() == 0);
  DUET_CHECK(!out.finished() || router::StreamFinishReason(out.finish_reason()).has_value());
}

void CheckTokenizerJson(const std::string& text) {
  static const std::string path = [] {
    char name[] = "/tmp/duet_fuzz_tokenizer_XXXXXX";
    const int fd = mkstemp(name);
    DUET_CHECK(fd >= 0);
    close(fd);
    return std::string(name);
  }();
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromFile(path);
  if (!tokenizer.ok()) {
    DUET_CHECK(!tokenizer.status().message().empty());
    return;
  }
  const std::vector<int32_t> ids = (*tokenizer)->Encode("Hello, wörld! def f(x):\n\treturn x  <s> 123", true);
  for (int32_t id : ids) DUET_CHECK(id >= 0 && id < (*tokenizer)->vocab_size());
  (void)(*tokenizer)->Decode(ids, /*skip_special_tokens=*/false);
  (void)(*tokenizer)->Decode(ids, /*skip_special_tokens=*/true);
}

void CheckChatTemplate(const std::string& source) {
  absl::StatusOr<ChatTemplate> parsed = ChatTemplate::Parse(source);
  if (!parsed.ok()) {
    DUET_CHECK(!parsed.status().message().empty());
    return;
  }
  static const nlohmann::ordered_json context = nlohmann::ordered_json::parse(R"({
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                 {"role": "assistant", "content": "hello"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>", "tools": null})");
  absl::StatusOr<std::string> rendered = parsed->Render(context);
  if (!rendered.ok()) DUET_CHECK(!rendered.status().message().empty());
}

// Every parser: the whole text and the text streamed in pieces (cut where the text's own bytes
// say) give the same content and calls; parsed calls' arguments are JSON objects.
void CheckToolCallParsers(const std::string& text) {
  using namespace router::openai;
  const std::vector<std::function<std::unique_ptr<ToolCallParser>(ToolCallIdFn)>> parsers = {
      [](ToolCallIdFn id) { return NewAutoToolCallParser(ToolCallFormat::kLlama3Json, 4, std::move(id)); },
      [](ToolCallIdFn id) { return NewAutoToolCallParser(ToolCallFormat::kHermes, 1 << 20, std::move(id)); },
      [](ToolCallIdFn id) { return NewRequiredToolCallParser(std::move(id)); },
      [](ToolCallIdFn id) { return NewNamedToolCallParser("f", std::move(id)); },
  };
  for (size_t p = 0; p < parsers.size(); ++p) {
    auto ids = [] {
      auto next = std::make_shared<int>(0);
      return ToolCallIdFn([next] { return std::to_string((*next)++); });
    };
    std::unique_ptr<ToolCallParser> whole_parser = parsers[p](ids());
    const ParsedOutput whole = ParseToolCalls(*whole_parser, text);
    std::unique_ptr<ToolCallParser> streaming = parsers[p](ids());
    ParsedOutput streamed;
    for (size_t at = 0; at < text.size();) {
      const size_t piece = std::min<size_t>(text.size() - at, 1 + (static_cast<unsigned char>(text[at]) % 13));
      OutputDelta delta;
      streaming->Push(std::string_view(text).substr(at, piece), &delta);
      Accumulate(delta, &streamed);
      at += piece;
    }
    OutputDelta last;
    streaming->Finish(&last);
    Accumulate(last, &streamed);
    DUET_CHECK(streamed.content == whole.content && streamed.calls.size() == whole.calls.size());
    DUET_CHECK(static_cast<int>(whole.calls.size()) == whole_parser->num_calls());
    for (size_t i = 0; i < whole.calls.size(); ++i) {
      DUET_CHECK(streamed.calls[i].name == whole.calls[i].name && streamed.calls[i].arguments == whole.calls[i].arguments);
      if (p < 3) DUET_CHECK(Json::parse(whole.calls[i].arguments, nullptr, /*allow_exceptions=*/false).is_object());
    }
  }
}

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The model's tokenizer.json cut to its first `max_id` tokens and the merges among them.
std::string SmallTokenizerJson(const std::string& full, int max_id) {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(full, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("model")) return "";
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  for (auto& [token, id] : j["model"]["vocab"].items()) {
    if (id.get<int>() < max_id) vocab[token] = id;
  }
  nlohmann::ordered_json merges = nlohmann::ordered_json::array();
  for (const auto& merge : j["model"]["merges"]) {
    std::string a, b;
    if (merge.is_string()) {
      const std::string m = merge.get<std::string>();
      const size_t space = m.find(' ');
      if (space == std::string::npos) continue;
      a = m.substr(0, space);
      b = m.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2) {
      a = merge[0].get<std::string>();
      b = merge[1].get<std::string>();
    }
    if (vocab.contains(a) && vocab.contains(b) && vocab.contains(a + b)) merges.push_back(merge);
  }
  j["model"]["vocab"] = vocab;
  j["model"]["merges"] = merges;
  nlohmann::ordered_json added = nlohmann::ordered_json::array();
  for (const auto& t : j["added_tokens"]) {
    if (t["id"].get<int>() < max_id) added.push_back(t);
  }
  j["added_tokens"] = added;
  return j.dump();
}

}  // namespace

namespace fuzz {

std::vector<std::string> Seeds() {
  std::vector<std::string> seeds;
  auto add = [&](int target, const std::string& payload) { seeds.push_back(std::string(1, char(target)) + payload); };
  add(0, R"({"model":"tiny-code-llama","prompt":"def f(x):","max_tokens":8,"temperature":0.7,"top_p":0.9,"stop":["\n\n"],"seed":3})");
  add(0, R"({"prompt":[[1,2,3],[4,5]],"n":2,"logprobs":2,"echo":false,"stream":true,"stream_options":{"include_usage":true}})");
  add(0, R"({"prompt":["a","b"],"max_tokens":1,"frequency_penalty":0.5,"presence_penalty":-0.5,"repetition_penalty":1.1,"top_k":5,"min_p":0.1,"ignore_eos":true,"request_id":"r1"})");
  add(1, R"({"model":"tiny-code-llama","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"hi"}],"max_tokens":4,"logprobs":true,"top_logprobs":2})");
  add(1, R"({"messages":[{"role":"user","content":[{"type":"text","text":"hello"}]},{"role":"assistant","content":"yes"},{"role":"user","content":"more"}],"stream":true,"max_completion_tokens":3,"stop":"x"})");
  add(1, R"({"messages":[{"role":"user","content":"w?"},{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},{"role":"tool","tool_call_id":"c","content":"21"}],"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}],"tool_choice":"required","parallel_tool_calls":false})");
  add(1, R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":{"type":"function","function":{"name":"f"}}})");
  add(2, R"({"prompt":"hello world <|begin_of_text|>","add_special_tokens":true})");
  add(2, R"({"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":true})");
  add(3, R"({"tokens":[0,1,2,100,8000]})");
  add(4, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"prompt\":1}\n"
         "GET /health HTTP/1.0\r\n\r\n");
  add(4, "POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n"
         "5\r\nhello\r\n0\r\n\r\n");
  kvtransfer::KvLayout layout;
  layout.num_layers = 2;
  layout.block_size = 16;
  layout.num_kv_heads = 4;
  layout.head_dim = 64;
  layout.dtype = kvtransfer::KvDtype::kBFloat16;
  add(5, layout.Serialize());
  layout.dtype = kvtransfer::KvDtype::kFloat32;
  layout.block_size = 1;
  add(5, layout.Serialize());
  const std::string tokenizer_json = ReadFileOrEmpty(kModelDir + "/tokenizer.json");
  const std::string small = SmallTokenizerJson(tokenizer_json, 400);
  if (!small.empty()) add(6, small);
  add(6, tokenizer_json);
  add(7, kFallbackChatTemplate);
  const std::string config = ReadFileOrEmpty(kModelDir + "/tokenizer_config.json");
  const nlohmann::json j = nlohmann::json::parse(config, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("chat_template") && j["chat_template"].is_string()) {
    add(7, j["chat_template"].get<std::string>());
  }
  add(7, "{% for m in messages %}{{ loop.index }}:{{ m.role|upper }}={{ m.content if m.content is string else "
         "m.content|tojson }}{% if not loop.last %}, {% endif %}{% endfor %}{% set x = [1, 2] %}{{ x|length }}"
         "{{ bos_token ~ (eos_token|default('?')) }}{% if tools is none %}-{% elif tools %}t{% endif %}");
  add(8, "Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, \"}\"]}}\n</tool_call>\n<tool_call>{bad");
  add(8, "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}; {\"name\": \"g\", \"arguments\": \"{}\"}");
  add(8, "[{\"name\": \"f\", \"parameters\": {\"x\": \"\\u00e9\\\"\"}}, {\"name\": \"g\", \"parameters\": {}}]");
  kvtransfer::ReceiverDescriptor descriptor;
  descriptor.layout = kvtransfer::KvLayout{2, 16, 4, 64, kvtransfer::KvDtype::kBFloat16};
  descriptor.num_blocks = 8;
  descriptor.host_id = "host/boot-id";
  descriptor.worker_address = std::string("\x01\x02ucx-address", 13);
  for (int i = 0; i < 4; ++i) descriptor.regions.push_back({0x7f0000000000u + uint64_t(i) * 0x10000, 0x10000, "rkey"});
  add(9, descriptor.Serialize());
  kvtransfer::Notice notice;
  notice.type = kvtransfer::NoticeType::kLayerDone;
  notice.flags = kvtransfer::Notice::kHasChecksums;
  notice.request_id = 7;
  notice.layer = 1;
  notice.num_tokens = 20;
  add(10, std::string(reinterpret_cast<const char*>(&notice), sizeof(notice)));
  v1::PrefillResponse prefilled;
  prefilled.set_first_token_id(42);
  prefilled.mutable_first_token_logprobs()->set_logprob(-0.5f);
  prefilled.mutable_first_token_logprobs()->add_top()->set_token_id(43);
  for (int i = 0; i < 3; ++i) {
    v1::TokenLogprobs* lp = prefilled.add_prompt_logprobs();
    lp->set_rank(1 + i);
    lp->add_top()->set_token_id(100 + i);
  }
  add(11, std::string("\x00\x03\x02", 3) + prefilled.SerializeAsString());  // a 4-token prompt, top 1
  v1::GenerateResponse streamed;
  streamed.add_token_ids(7);
  streamed.add_token_ids(8);
  streamed.add_logprobs()->add_top()->set_token_id(9);
  streamed.add_logprobs()->set_logprob(-1.0f);
  streamed.set_text("ab");
  streamed.set_finished(true);
  streamed.set_finish_reason("length");
  add(11, std::string("\x01\x00\x00", 3) + streamed.SerializeAsString());
  return seeds;
}

}  // namespace fuzz
}  // namespace duet

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string payload(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % duet::kTargets) {
    case 0: duet::CheckRequest(payload, /*chat=*/false); break;
    case 1: duet::CheckRequest(payload, /*chat=*/true); break;
    case 2: duet::CheckTokenize(payload, /*tokenize=*/true); break;
    case 3: duet::CheckTokenize(payload, /*tokenize=*/false); break;
    case 4: duet::CheckHttpRequest(payload); break;
    case 5: duet::CheckKvLayout(payload); break;
    case 6: duet::CheckTokenizerJson(payload); break;
    case 7: duet::CheckChatTemplate(payload); break;
    case 8: duet::CheckToolCallParsers(payload); break;
    case 9: duet::CheckReceiverDescriptor(payload); break;
    case 10: duet::CheckNotice(payload); break;
    default: duet::CheckWorkerReply(payload); break;
  }
  return 0;
}
