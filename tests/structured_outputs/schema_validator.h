// A JSON Schema validator for the keywords of the structured-output test set, written from the
// specification (2020-12) and independent of the grammar converter it checks: type, properties,
// required, additionalProperties, items, prefixItems, minItems, maxItems, enum, const, anyOf,
// oneOf, allOf, $ref, minLength, maxLength (code points), pattern (ECMAScript, searched).
// Returns the empty string when `value` is valid, else where and why it is not.
#pragma once

#include <regex>
#include <string>

#include "nlohmann/json.hpp"

namespace duet::testing {

inline size_t CodePoints(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

inline std::string ValidateJson(const nlohmann::json& value, const nlohmann::json& schema,
                                const nlohmann::json& root, const std::string& at = "$") {
  using json = nlohmann::json;
  if (schema.is_boolean()) return schema.get<bool>() ? "" : at + ": schema false";
  if (schema.contains("$ref")) {
    const std::string ref = schema["$ref"];
    if (ref == "#") return ValidateJson(value, root, root, at);
    const std::string prefix = ref.starts_with("#/$defs/") ? "$defs" : "definitions";
    return ValidateJson(value, root[prefix][ref.substr(ref.find_last_of('/') + 1)], root, at);
  }
  if (schema.contains("type")) {
    auto is = [&](const std::string& t) {
      if (t == "object") return value.is_object();
      if (t == "array") return value.is_array();
      if (t == "string") return value.is_string();
      if (t == "integer") return value.is_number_integer() || (value.is_number_float() && value.get<double>() == double(int64_t(value.get<double>())));
      if (t == "number") return value.is_number();
      if (t == "boolean") return value.is_boolean();
      if (t == "null") return value.is_null();
      return false;
    };
    bool ok = false;
    if (schema["type"].is_array()) {
      for (const json& t : schema["type"]) ok |= is(t.get<std::string>());
    } else {
      ok = is(schema["type"].get<std::string>());
    }
    if (!ok) return at + ": not of type " + schema["type"].dump();
  }
  if (schema.contains("const") && value != schema["const"]) return at + ": not the const " + schema["const"].dump();
  if (schema.contains("enum")) {
    bool found = false;
    for (const json& v : schema["enum"]) found |= v == value;
    if (!found) return at + ": not in enum";
  }
  if (schema.contains("anyOf")) {
    bool any = false;
    for (const json& s : schema["anyOf"]) any |= ValidateJson(value, s, root, at).empty();
    if (!any) return at + ": matches no anyOf branch";
  }
  if (schema.contains("oneOf")) {
    int n = 0;
    for (const json& s : schema["oneOf"]) n += ValidateJson(value, s, root, at).empty();
    if (n != 1) return at + ": matches " + std::to_string(n) + " oneOf branches";
  }
  if (schema.contains("allOf")) {
    for (const json& s : schema["allOf"]) {
      if (std::string e = ValidateJson(value, s, root, at); !e.empty()) return e;
    }
  }
  if (value.is_string()) {
    const std::string s = value.get<std::string>();
    if (schema.contains("minLength") && CodePoints(s) < schema["minLength"].get<size_t>()) return at + ": too short";
    if (schema.contains("maxLength") && CodePoints(s) > schema["maxLength"].get<size_t>()) return at + ": too long";
    if (schema.contains("pattern") && !std::regex_search(s, std::regex(schema["pattern"].get<std::string>()))) {
      return at + ": does not match the pattern";
    }
  }
  if (value.is_array()) {
    if (schema.contains("minItems") && value.size() < schema["minItems"].get<size_t>()) return at + ": too few items";
    if (schema.contains("maxItems") && value.size() > schema["maxItems"].get<size_t>()) return at + ": too many items";
    size_t first = 0;
    if (schema.contains("prefixItems")) {
      const json& prefix = schema["prefixItems"];
      for (; first < prefix.size() && first < value.size(); ++first) {
        if (std::string e = ValidateJson(value[first], prefix[first], root, at + "[" + std::to_string(first) + "]"); !e.empty()) return e;
      }
    }
    if (schema.contains("items")) {
      for (size_t i = first; i < value.size(); ++i) {
        if (std::string e = ValidateJson(value[i], schema["items"], root, at + "[" + std::to_string(i) + "]"); !e.empty()) return e;
      }
    }
  }
  if (value.is_object()) {
    const json empty = json::object();
    const json& props = schema.contains("properties") ? schema["properties"] : empty;
    if (schema.contains("required")) {
      for (const json& r : schema["required"]) {
        if (!value.contains(r.get<std::string>())) return at + ": missing required " + r.get<std::string>();
      }
    }
    for (const auto& [key, v] : value.items()) {
      if (props.contains(key)) {
        if (std::string e = ValidateJson(v, props[key], root, at + "." + key); !e.empty()) return e;
      } else if (schema.contains("additionalProperties")) {
        if (std::string e = ValidateJson(v, schema["additionalProperties"], root, at + "." + key); !e.empty()) return e;
      }
    }
  }
  return "";
}

}  // namespace duet::testing
