// Runtime values of the chat-template interpreter: a dynamically typed value that mirrors
// @huggingface/jinja's runtime (undefined, none, bool, int, float, string, list, dict,
// namespace, callable). Lists, dicts and namespaces are shared by reference, as in Jinja.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"

namespace duet::jinja {

struct Value;
using Array = std::vector<Value>;
// Insertion-ordered, as JSON objects in templates (tojson) must keep their key order.
using Object = std::vector<std::pair<std::string, Value>>;

struct CallArgs {
  std::vector<Value> positional;
  Object keyword;
};
using Callable = std::function<Value(CallArgs&)>;

// Thrown inside the interpreter only; ChatTemplate::Render turns it into a Status.
struct TemplateError {
  std::string message;
};

struct Value {
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kArray, kObject, kNamespace, kFunction };

  Kind kind = Kind::kUndefined;
  bool boolean = false;
  int64_t integer = 0;
  double number = 0;
  std::string string;
  std::shared_ptr<Array> array;
  std::shared_ptr<Object> object;  // dict or namespace
  std::shared_ptr<const Callable> function;

  static Value None();
  static Value Bool(bool b);
  static Value Int(int64_t i);
  static Value Float(double d);
  static Value String(std::string s);
  static Value List(Array items);
  static Value Dict(Object items);
  static Value Namespace(Object items);
  static Value Function(Callable fn);
  static Value FromJson(const nlohmann::ordered_json& json);

  bool IsUndefined() const { return kind == Kind::kUndefined; }
  bool IsNumber() const { return kind == Kind::kInt || kind == Kind::kFloat; }
  bool IsMapping() const { return kind == Kind::kObject || kind == Kind::kNamespace; }
  double AsDouble() const { return kind == Kind::kFloat ? number : static_cast<double>(integer); }

  bool Truthy() const;
  // Dict/namespace member, or nullptr.
  const Value* Find(const std::string& key) const;
  const char* TypeName() const;
};

// How `{{ value }}` prints: none/undefined print nothing, floats keep a ".0", lists and dicts as JSON.
std::string ToOutputString(const Value& value);
// JavaScript's String(value): what `+` and `~` concatenate (floats print like JS numbers).
std::string ToConcatString(const Value& value);

struct JsonOptions {
  int indent = 0;  // 0: single line
  bool ensure_ascii = false;
  bool sort_keys = false;
  std::string item_separator;  // empty: default (", " or "," with indent)
  std::string key_separator;   // empty: ": "
  bool undefined_as_null = true;
};
// Matches @huggingface/jinja's tojson (JSON.stringify escaping, Python-style separators).
std::string ToJson(const Value& value, const JsonOptions& options, int depth = 0);

// JavaScript's Number.prototype.toString for finite doubles.
std::string FormatJsNumber(double d);

// Loose equality as the reference implements `==` (numbers across int/float/bool, none == undefined).
bool LooseEquals(const Value& a, const Value& b);

}  // namespace duet::jinja
