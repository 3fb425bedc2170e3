#include "frontend/chat_template/chat_template.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace duet {
namespace {

using Json = nlohmann::ordered_json;

// Renders source with context; a failure shows as "ERROR: <message>".
std::string RenderOrError(const std::string& source, const Json& context = Json::object()) {
  absl::StatusOr<ChatTemplate> chat_template = ChatTemplate::Parse(source);
  if (!chat_template.ok()) return "ERROR: " + std::string(chat_template.status().message());
  absl::StatusOr<std::string> out = chat_template->Render(context);
  return out.ok() ? *out : "ERROR: " + std::string(out.status().message());
}

TEST(ChatTemplate, TextExpressionsAndComments) {
  EXPECT_EQ(RenderOrError("Hi {{ name }}!{# note #}", {{"name", "Ann"}}), "Hi Ann!");
  EXPECT_EQ(RenderOrError("{{ 'a' 'b' }}{{ \"\\n\\t\\u00e9\\x41\" }}"), "ab\n\té" "A");
  EXPECT_EQ(RenderOrError("{{ [1, 'x', none, true] }}|{{ {'k': 1.5} }}|{{ 2.0 }}|{{ none }}"),
            "[1, \"x\", null, true]|{\"k\": 1.5}|2.0|");
}

TEST(ChatTemplate, WhitespaceControlAndHuggingFaceBlockTrimming) {
  EXPECT_EQ(RenderOrError("a  {{- 'b' -}}  c"), "abc");
  EXPECT_EQ(RenderOrError("a \n{%- if true -%}\n b {%- endif %}"), "ab");
  // trim_blocks removes the newline after a tag; lstrip_blocks the indentation before one.
  EXPECT_EQ(RenderOrError("{% if true %}\n    {% if true %}\nx\n    {% endif %}\n{% endif %}\n"), "x\n");
  EXPECT_EQ(RenderOrError("line\n"), "line");  // one trailing newline dropped, as HF does
  EXPECT_EQ(RenderOrError("  {{ 'kept' }}"), "  kept");
}

TEST(ChatTemplate, Conditionals) {
  const std::string source = "{% if x > 2 %}big{% elif x == 2 %}two{% else %}small{% endif %}";
  EXPECT_EQ(RenderOrError(source, {{"x", 3}}), "big");
  EXPECT_EQ(RenderOrError(source, {{"x", 2}}), "two");
  EXPECT_EQ(RenderOrError(source, {{"x", 1}}), "small");
  EXPECT_EQ(RenderOrError("{{ 'y' if missing else 'n' }}{{ 'a' if 1 and not 0 or 0 else 'b' }}"), "na");
  EXPECT_EQ(RenderOrError("{{ 0 or 'd' }}{{ 'x' and 'y' }}"), "dy");
}

TEST(ChatTemplate, LoopsAndLoopVariables) {
  Json context = {{"items", {"a", "b", "c"}}};
  EXPECT_EQ(RenderOrError("{% for i in items %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ i }}"
                          "{{ '^' if loop.first }}{{ '$' if loop.last }}{{ loop.length }};{% endfor %}",
                          context),
            "103a^3;212b3;321c$3;");
  EXPECT_EQ(RenderOrError("{% for i in items %}{{ loop.previtem }}<{{ i }}>{{ loop.nextitem }} {% endfor %}", context),
            "<a>b a<b>c b<c> ");
  EXPECT_EQ(RenderOrError("{% for i in items if i != 'b' %}{{ i }}{{ loop.index }}{% endfor %}", context), "a1c2");
  EXPECT_EQ(RenderOrError("{% for i in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(RenderOrError("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}{{ v }}{% endfor %}"), "a1b2");
  EXPECT_EQ(RenderOrError("{% for k in {'a': 1, 'b': 2} %}{{ k }}{% endfor %}"), "ab");
  EXPECT_EQ(RenderOrError("{% for i in range(10) %}{% if i % 2 %}{% continue %}{% endif %}{% if i > 6 %}{% break %}"
                          "{% endif %}{{ i }}{% endfor %}"),
            "0246");
  EXPECT_EQ(RenderOrError("{% for x in undefined_thing %}x{% endfor %}ok"), "ok");
}

TEST(ChatTemplate, SetNamespaceAndScoping) {
  EXPECT_EQ(RenderOrError("{% set a, b = 1, 2 %}{{ a + b }}"), "3");
  EXPECT_EQ(RenderOrError("{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{% endfor %}{{ x }}"), "1");
  EXPECT_EQ(RenderOrError("{% set ns = namespace(x=1) %}{% for i in [1, 2] %}{% set ns.x = ns.x + i %}{% endfor %}"
                          "{{ ns.x }}"),
            "4");
  EXPECT_EQ(RenderOrError("{% set block %}a{{ 1 + 1 }}b{% endset %}[{{ block }}]"), "[a2b]");
  EXPECT_EQ(RenderOrError("{% set d = {'a': 1} %}{% set d.a = 2 %}"),
            "ERROR: template error at line 1, column 30: cannot assign an attribute of a non-namespace object");
}

TEST(ChatTemplate, MacrosAndCallBlocks) {
  EXPECT_EQ(RenderOrError("{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}"
                          "{{ greet('Ann') }} {{ greet('Bo', punct='?') }}"),
            "Hi Ann! Hi Bo?");
  EXPECT_EQ(RenderOrError("{% macro wrap() %}<{{ caller() }}>{% endmacro %}{% call wrap() %}inner{% endcall %}"),
            "<inner>");
  EXPECT_EQ(RenderOrError("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"),
            "ERROR: template error at line 1, column 19: macro calls nested too deeply");
}

TEST(ChatTemplate, Filters) {
  EXPECT_EQ(RenderOrError("{{ '  x  ' | trim }}|{{ 'aB' | upper }}{{ 'aB' | lower }}|{{ 'hello world' | title }}|"
                          "{{ 'hello' | capitalize }}|{{ [1, 2, 3] | length }}{{ 'héllo' | length }}"),
            "x|ABab|Hello World|Hello|35");
  EXPECT_EQ(RenderOrError("{{ [3, 1, 2] | first }}{{ [3, 1, 2] | last }}{{ [3, 1, 2] | reverse | join(',') }}"
                          "{{ [3, 1, 2] | sort | join }}{{ [1, 1, 2] | unique | join('-') }}"),
            "322,1,31231-2");
  EXPECT_EQ(RenderOrError("{{ missing | default('d') }}{{ '' | default('e', true) }}{{ 'v' | default('f') }}"), "dev");
  EXPECT_EQ(RenderOrError("{{ '42' | int + 1 }} {{ '2.5' | float }} {{ 'x' | int }} {{ 3.9 | int }} {{ 7 | string }}"),
            "43 2.5 0 3 7");
  EXPECT_EQ(RenderOrError("{{ 'a-b-c' | replace('-', '+') }} {{ 'x' | safe }} {{ {'a': 1} | items | list }}"),
            "a+b+c x [[\"a\", 1]]");
  EXPECT_EQ(RenderOrError("{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(1, true) }}"), "a\n  b\n\n  c| a\n b");
  Json people = {{"people", Json::array({{{"name", "A"}, {"ok", true}}, {{"name", "B"}, {"ok", false}}})}};
  EXPECT_EQ(RenderOrError("{{ people | map(attribute='name') | join(',') }}|"
                          "{{ people | selectattr('ok') | map(attribute='name') | join }}|"
                          "{{ people | rejectattr('ok') | map(attribute='name') | join }}|"
                          "{{ people | selectattr('name', 'equalto', 'B') | list | length }}",
                          people),
            "A,B|A|B|1");
  EXPECT_EQ(RenderOrError("{% filter upper %}shout{% endfilter %}"), "SHOUT");
}

TEST(ChatTemplate, ToJsonMatchesHuggingFace) {
  Json context = {{"v", Json::parse(R"({"z": 1, "a": ["é", "\"q\"", "\u0001"], "f": 0.5, "n": null, "e": {}})")}};
  EXPECT_EQ(RenderOrError("{{ v | tojson }}", context),
            R"({"z": 1, "a": ["é", "\"q\"", "\u0001"], "f": 0.5, "n": null, "e": {}})");
  EXPECT_EQ(RenderOrError("{{ v.a | tojson(indent=2) }}", context), "[\n  \"é\",\n  \"\\\"q\\\"\",\n  \"\\u0001\"\n]");
  EXPECT_EQ(RenderOrError("{{ v.a[0] | tojson(ensure_ascii=true) }}{{ '😀' | tojson(ensure_ascii=true) }}", context),
            "\"\\u00e9\"\"\\ud83d\\ude00\"");
  EXPECT_EQ(RenderOrError("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true, separators=(',', ':')) }}"), R"({"a":2,"b":1})");
}

TEST(ChatTemplate, Tests) {
  EXPECT_EQ(RenderOrError("{{ x is defined }}{{ y is defined }}{{ y is undefined }}{{ n is none }}{{ x is not none }}",
                          {{"x", 1}, {"n", nullptr}}),
            "truefalsetruetruetrue");
  EXPECT_EQ(RenderOrError("{{ 's' is string }}{{ 1 is number }}{{ 1.5 is number }}{{ {} is mapping }}{{ [] is iterable }}"
                          "{{ 's' is iterable }}{{ [] is sequence }}{{ true is boolean }}{{ true is true }}"
                          "{{ 0 is false }}{{ 3 is odd }}{{ 3 is even }}"),
            "truetruetruetruetruetruetruetruetruefalsetruefalse");
  // Attribute access on undefined inside tests does not fail.
  EXPECT_EQ(RenderOrError("{{ m.reasoning_content is defined }}{{ m.a.b.c is none }}", {{"m", Json::object()}}),
            "falsefalse");
}

TEST(ChatTemplate, OperatorsAndSlicing) {
  EXPECT_EQ(RenderOrError("{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ 7 / 2 }} {{ 2 ** 8 }} {{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }}"),
            "3 -4 1 3.5 256 7 9");
  EXPECT_EQ(RenderOrError("{{ 'a' ~ 1 ~ true }} {{ 'a' + 'b' }} {{ [1] + [2] }} {{ 1 < 2 }} {{ 2 >= 3 }} {{ 1 == 1.0 }}"),
            "a1true ab [1, 2] true false true");
  EXPECT_EQ(RenderOrError("{{ 'b' in 'abc' }}{{ 'z' not in ['a'] }}{{ 'k' in {'k': 1} }}{{ 'x' in missing }}"),
            "truetruetruefalse");
  EXPECT_EQ(RenderOrError("{{ 'hello'[1:3] }} {{ 'hello'[::-1] }} {{ [1, 2, 3, 4][1:] }} {{ [1, 2, 3][-1] }} "
                          "{{ [1, 2, 3, 4][::2] }} {{ 'héllo'[1] }}"),
            "el olleh [2, 3, 4] 3 [1, 3] é");
}

TEST(ChatTemplate, StringAndDictMethods) {
  EXPECT_EQ(RenderOrError("{{ '  a  '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ '\\n\\na'.lstrip('\\n') }}|"
                          "{{ 'a  '.rstrip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|"
                          "{{ 'a,b,c'.split(',', 1) }}"),
            "a|a|a|a|[\"a\", \"b\", \"\", \"c\"]|[\"a\", \"b\"]|[\"a\", \"b,c\"]");
  EXPECT_EQ(RenderOrError("{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'c')) }}{{ 'Ab'.upper() }}"
                          "{{ 'Ab'.lower() }}{{ 'a-a'.replace('-', '') }}{{ 'ab cd'.title() }}"),
            "truetrueABabaaAb Cd");
  Json context = {{"d", {{"a", 1}, {"b", 2}}}};
  EXPECT_EQ(RenderOrError("{{ d.get('a') }}{{ d.get('z', 'dz') }}{{ d.get('z') is none }}{{ d.keys() | list }}"
                          "{{ d.values() | list }}{{ d['b'] }}",
                          context),
            "1dztrue[\"a\", \"b\"][1, 2]2");
}

TEST(ChatTemplate, GlobalsRaiseExceptionAndStrftime) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse("{{ raise_exception('Roles must alternate!') }}");
  ASSERT_TRUE(t.ok());
  absl::StatusOr<std::string> out = t->Render(Json::object());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out.status().message(), "Roles must alternate!");
  EXPECT_EQ(RenderOrError("{{ strftime_now('%Y') | length }}"), "4");
  EXPECT_EQ(RenderOrError("{{ True }}{{ False }}{{ None is none }}{{ range(2, 8, 3) }}"), "truefalsetrue[2, 5]");
}

TEST(ChatTemplate, SyntaxErrorsNameLineAndColumn) {
  auto parse_error = [](const std::string& source) {
    absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(source);
    EXPECT_FALSE(t.ok()) << source;
    if (!t.ok()) {
      EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    }
    return t.ok() ? std::string() : std::string(t.status().message());
  };
  EXPECT_EQ(parse_error("a\n  {% if x %}yes"), "template syntax error at line 2, column 3: unclosed block: missing {% endif %}");
  EXPECT_EQ(parse_error("{% for x in y %}"), "template syntax error at line 1, column 1: unclosed block: missing {% endfor %}");
  EXPECT_EQ(parse_error("{{ 'unterminated }}"), "template syntax error at line 1, column 4: unterminated string literal");
  EXPECT_EQ(parse_error("{% frobnicate %}"), "template syntax error at line 1, column 4: unknown statement 'frobnicate'");
  EXPECT_EQ(parse_error("{{ (1 + }}"), "template syntax error at line 1, column 9: unexpected '}}'");
  EXPECT_EQ(parse_error("{# never closed"), "template syntax error at line 1, column 1: missing end of comment tag '#}'");
  EXPECT_FALSE(parse_error("{% endif %}").empty());
  EXPECT_FALSE(parse_error("{{ x").empty());
  EXPECT_FALSE(parse_error("{{ " + std::string(5000, '(')).empty());  // nesting limit, no stack overflow
}

TEST(ChatTemplate, RuntimeErrorsAreClear) {
  EXPECT_EQ(RenderOrError("{{ x | frobnicate }}", {{"x", 1}}), "ERROR: template error at line 1, column 4: unknown filter 'frobnicate'");
  EXPECT_EQ(RenderOrError("{{ x is frobnicated }}"), "ERROR: template error at line 1, column 4: unknown test 'frobnicated'");
  EXPECT_EQ(RenderOrError("{{ x.nope() }}", {{"x", "s"}}), "ERROR: template error at line 1, column 4: cannot call undefined (not a function)");
  EXPECT_EQ(RenderOrError("{{ 'a' ~ none }}"), "ERROR: template error at line 1, column 4: cannot apply '~' to string and none");
  EXPECT_EQ(RenderOrError("{{ 1 // 0 }}"), "ERROR: template error at line 1, column 4: division by zero");
  EXPECT_EQ(RenderOrError("{{ [1] | trim }}"), "ERROR: template error at line 1, column 4: cannot apply filter 'trim' to list");
  EXPECT_EQ(RenderOrError("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
            "ERROR: template error at line 1, column 29: template exceeded its evaluation budget");
  EXPECT_EQ(RenderOrError("{% set s = 'xxxxxxxxxxxxxxxx' %}{% for i in range(40) %}{% set s = s + s %}{% endfor %}"),
            "ERROR: template error at line 1, column 68: template output too large");
}

TEST(ChatTemplate, FallbackTemplateRendersChatML) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(kFallbackChatTemplate);
  ASSERT_TRUE(t.ok()) << t.status();
  Json context = {{"messages", Json::array({{{"role", "system"}, {"content", "S"}}, {{"role", "user"}, {"content", "U"}}})},
                  {"add_generation_prompt", true}};
  EXPECT_EQ(*t->Render(context), "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplate, LoadChatTemplateFromModelDirectories) {
  // The bundled tiny model has no chat_template: the fallback is used, with its bos/eos tokens.
  absl::StatusOr<LoadedChatTemplate> tiny = LoadChatTemplate(std::string(DUET_MODELS_DIR) + "/tiny-code-llama");
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  EXPECT_TRUE(tiny->is_fallback);
  EXPECT_EQ(tiny->bos_token, "<|begin_of_text|>");
  EXPECT_EQ(tiny->eos_token, "<|end_of_text|>");
  EXPECT_EQ(tiny->chat_template.source(), kFallbackChatTemplate);

  std::filesystem::path dir = std::filesystem::temp_directory_path() / ("duet_chat_template_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  auto write_config = [&](const Json& config) { std::ofstream(dir / "tokenizer_config.json") << config.dump(); };
  write_config({{"chat_template", Json::array({{{"name", "tool_use"}, {"template", "T"}}, {{"name", "default"}, {"template", "D{{ bos_token }}"}}})},
                {"bos_token", {{"content", "<s>"}, {"lstrip", false}}},
                {"eos_token", "</s>"}});
  absl::StatusOr<LoadedChatTemplate> listed = LoadChatTemplate(dir.string());
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_FALSE(listed->is_fallback);
  EXPECT_EQ(listed->chat_template.source(), "D{{ bos_token }}");
  EXPECT_EQ(listed->bos_token, "<s>");
  EXPECT_EQ(*listed->chat_template.Render({{"bos_token", listed->bos_token}}), "D<s>");

  write_config({{"chat_template", "{% if %}"}});
  EXPECT_EQ(LoadChatTemplate(dir.string()).status().code(), absl::StatusCode::kInvalidArgument);
  std::ofstream(dir / "tokenizer_config.json") << "{not json";
  EXPECT_EQ(LoadChatTemplate(dir.string()).status().code(), absl::StatusCode::kInvalidArgument);
  std::filesystem::remove_all(dir);
  EXPECT_EQ(LoadChatTemplate(dir.string()).status().code(), absl::StatusCode::kNotFound);
}

// --chat-template: a file, or an inline template (with escapes read), replacing the model's
// template; the model's bos/eos tokens stay.
TEST(ChatTemplate, ChatTemplateFlagReplacesTheModelsTemplate) {
  const std::string tiny = std::string(DUET_MODELS_DIR) + "/tiny-code-llama";
  std::filesystem::path dir = std::filesystem::temp_directory_path() / ("duet_chat_flag_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string file = (dir / "t.jinja").string();
  std::ofstream(file) << "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ eos_token }}\n";
  absl::StatusOr<LoadedChatTemplate> from_file = LoadChatTemplate(tiny, file);
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  EXPECT_FALSE(from_file->is_fallback);
  EXPECT_EQ(from_file->eos_token, "<|end_of_text|>");
  const Json context = {{"messages", Json::array({{{"role", "user"}, {"content", "U"}}})},
                        {"eos_token", from_file->eos_token}};
  EXPECT_EQ(*from_file->chat_template.Render(context), "[U]<|end_of_text|>");

  absl::StatusOr<LoadedChatTemplate> inline_template = LoadChatTemplate(tiny, "{{ messages[0]['content'] }}\\n\\t\\'!");
  ASSERT_TRUE(inline_template.ok()) << inline_template.status();
  EXPECT_EQ(*inline_template->chat_template.Render(context), "U\n\t'!");
  // A directory without tokenizer_config.json still takes a template of its own.
  EXPECT_TRUE(LoadChatTemplate(dir.string(), file).ok());

  absl::StatusOr<LoadedChatTemplate> bad = LoadChatTemplate(tiny, "{% if %}");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::string(bad.status().message()).starts_with("--chat-template: ")) << bad.status();
  absl::StatusOr<LoadedChatTemplate> missing = LoadChatTemplate(tiny, (dir / "missing.jinja").string());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("looks like a file path"), std::string::npos) << missing.status();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace duet
