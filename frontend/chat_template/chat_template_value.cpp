#include "frontend/chat_template/chat_template_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace duet::jinja {

Value Value::None() {
  Value v;
  v.kind = Kind::kNone;
  return v;
}

Value Value::Bool(bool b) {
  Value v;
  v.kind = Kind::kBool;
  v.boolean = b;
  return v;
}

Value Value::Int(int64_t i) {
  Value v;
  v.kind = Kind::kInt;
  v.integer = i;
  return v;
}

Value Value::Float(double d) {
  Value v;
  v.kind = Kind::kFloat;
  v.number = d;
  return v;
}

Value Value::String(std::string s) {
  Value v;
  v.kind = Kind::kString;
  v.string = std::move(s);
  return v;
}

Value Value::List(Array items) {
  Value v;
  v.kind = Kind::kArray;
  v.array = std::make_shared<Array>(std::move(items));
  return v;
}

Value Value::Dict(Object items) {
  Value v;
  v.kind = Kind::kObject;
  v.object = std::make_shared<Object>(std::move(items));
  return v;
}

Value Value::Namespace(Object items) {
  Value v = Dict(std::move(items));
  v.kind = Kind::kNamespace;
  return v;
}

Value Value::Function(Callable fn) {
  Value v;
  v.kind = Kind::kFunction;
  v.function = std::make_shared<const Callable>(std::move(fn));
  return v;
}

Value Value::FromJson(const nlohmann::ordered_json& json) {
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::null:
      return None();
    case nlohmann::ordered_json::value_t::boolean:
      return Bool(json.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Int(json.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned:
      return Int(static_cast<int64_t>(json.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float: {
      // JavaScript has one number type: integral floats become integers, as in the reference.
      double d = json.get<double>();
      if (std::isfinite(d) && d == std::trunc(d) && std::fabs(d) < 9.007199254740992e15) {
        return Int(static_cast<int64_t>(d));
      }
      return Float(d);
    }
    case nlohmann::ordered_json::value_t::string:
      return String(json.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      Array items;
      items.reserve(json.size());
      for (const auto& item : json) items.push_back(FromJson(item));
      return List(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Object items;
      items.reserve(json.size());
      for (const auto& [key, item] : json.items()) items.emplace_back(key, FromJson(item));
      return Dict(std::move(items));
    }
    default:
      return Value();
  }
}

bool Value::Truthy() const {
  switch (kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return boolean;
    case Kind::kInt:
      return integer != 0;
    case Kind::kFloat:
      return number != 0 && !std::isnan(number);
    case Kind::kString:
      return !string.empty();
    case Kind::kArray:
      return !array->empty();
    case Kind::kObject:
      return !object->empty();
    case Kind::kNamespace:
    case Kind::kFunction:
      return true;
  }
  return false;
}

const Value* Value::Find(const std::string& key) const {
  if (!IsMapping()) return nullptr;
  for (const auto& [name, value] : *object) {
    if (name == key) return &value;
  }
  return nullptr;
}

const char* Value::TypeName() const {
  switch (kind) {
    case Kind::kUndefined: return "undefined";
    case Kind::kNone: return "none";
    case Kind::kBool: return "boolean";
    case Kind::kInt: return "integer";
    case Kind::kFloat: return "float";
    case Kind::kString: return "string";
    case Kind::kArray: return "list";
    case Kind::kObject: return "dict";
    case Kind::kNamespace: return "namespace";
    case Kind::kFunction: return "function";
  }
  return "?";
}

std::string FormatJsNumber(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  if (d == 0) return "0";
  if (d == std::trunc(d) && std::fabs(d) < 1e21) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.0f", d);
    return buf;
  }
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), d);
  return std::string(buf, end);
}

std::string ToConcatString(const Value& value) {
  switch (value.kind) {
    case Value::Kind::kUndefined: return "undefined";
    case Value::Kind::kNone: return "null";
    case Value::Kind::kBool: return value.boolean ? "true" : "false";
    case Value::Kind::kInt: return std::to_string(value.integer);
    case Value::Kind::kFloat: return FormatJsNumber(value.number);
    case Value::Kind::kString: return value.string;
    case Value::Kind::kArray: {
      std::string out;
      for (size_t i = 0; i < value.array->size(); ++i) {
        if (i > 0) out += ',';
        const Value& item = (*value.array)[i];
        if (item.kind != Value::Kind::kNone && !item.IsUndefined()) out += ToConcatString(item);
      }
      return out;
    }
    case Value::Kind::kObject:
    case Value::Kind::kNamespace: return "[object Map]";
    case Value::Kind::kFunction: return "[function]";
  }
  return "";
}

std::string ToOutputString(const Value& value) {
  switch (value.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return "";
    case Value::Kind::kFloat: {
      if (value.number == 0 && std::signbit(value.number)) return "-0.0";
      std::string s = FormatJsNumber(value.number);
      if (std::isfinite(value.number) && value.number == std::trunc(value.number)) s += ".0";
      return s;
    }
    case Value::Kind::kArray:
    case Value::Kind::kObject:
    case Value::Kind::kNamespace: {
      JsonOptions options;
      options.undefined_as_null = false;
      return ToJson(value, options);
    }
    default: return ToConcatString(value);
  }
}

namespace {

// JSON.stringify's string escaping; with ensure_ascii, non-ASCII becomes \uXXXX (UTF-16 units).
std::string QuoteJson(const std::string& s, bool ensure_ascii) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '"': out += "\\\""; continue;
      case '\\': out += "\\\\"; continue;
      case '\b': out += "\\b"; continue;
      case '\f': out += "\\f"; continue;
      case '\n': out += "\\n"; continue;
      case '\r': out += "\\r"; continue;
      case '\t': out += "\\t"; continue;
      default: break;
    }
    char buf[16];
    if (c < 0x20) {
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else if (c < 0x7f || !ensure_ascii) {
      out += static_cast<char>(c);
    } else if (c == 0x7f) {
      out += "\\u007f";
    } else {
      // Decode one UTF-8 sequence; malformed bytes are escaped as themselves.
      uint32_t cp = c;
      int extra = c >= 0xf0 ? 3 : c >= 0xe0 ? 2 : c >= 0xc0 ? 1 : 0;
      if (extra > 0 && i + extra < s.size()) {
        cp = c & (0x3f >> extra);
        for (int k = 1; k <= extra; ++k) {
          cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
        }
        i += extra;
      }
      if (cp >= 0x10000) {
        cp -= 0x10000;
        std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xd800 + (cp >> 10), 0xdc00 + (cp & 0x3ff));
      } else {
        std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
      }
      out += buf;
    }
  }
  out += '"';
  return out;
}

}  // namespace

std::string ToJson(const Value& value, const JsonOptions& options, int depth) {
  if (depth > 256) throw TemplateError{"tojson: value nested too deeply"};
  std::string item_sep = !options.item_separator.empty() ? options.item_separator
                         : options.indent > 0            ? ","
                                                         : ", ";
  std::string key_sep = !options.key_separator.empty() ? options.key_separator : ": ";
  switch (value.kind) {
    case Value::Kind::kUndefined: return options.undefined_as_null ? "null" : "undefined";
    case Value::Kind::kNone: return "null";
    case Value::Kind::kBool: return value.boolean ? "true" : "false";
    case Value::Kind::kInt: return std::to_string(value.integer);
    case Value::Kind::kFloat: return std::isfinite(value.number) ? FormatJsNumber(value.number) : "null";
    case Value::Kind::kString: return QuoteJson(value.string, options.ensure_ascii);
    case Value::Kind::kFunction: throw TemplateError{"Cannot convert to JSON: function"};
    default: break;
  }
  std::string indent_unit(std::max(options.indent, 0), ' ');
  std::string base_padding = "\n";
  for (int i = 0; i < depth; ++i) base_padding += indent_unit;
  std::string child_padding = base_padding + indent_unit;
  bool pretty = options.indent > 0;
  std::vector<std::string> parts;
  if (value.kind == Value::Kind::kArray) {
    for (const Value& item : *value.array) parts.push_back(ToJson(item, options, depth + 1));
  } else {
    Object entries = *value.object;
    if (options.sort_keys) {
      std::stable_sort(entries.begin(), entries.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
    }
    for (const auto& [key, item] : entries) {
      std::string part = QuoteJson(key, options.ensure_ascii) + key_sep + ToJson(item, options, depth + 1);
      parts.push_back(pretty ? child_padding + part : part);
    }
  }
  bool is_array = value.kind == Value::Kind::kArray;
  std::string out(1, is_array ? '[' : '{');
  if (pretty && !parts.empty() && is_array) out += child_padding;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) out += item_sep + (pretty && is_array ? child_padding : "");
    out += parts[i];
  }
  if (pretty && !parts.empty()) out += base_padding;
  out += is_array ? ']' : '}';
  return out;
}

bool LooseEquals(const Value& a, const Value& b) {
  auto nullish = [](const Value& v) { return v.IsUndefined() || v.kind == Value::Kind::kNone; };
  if (nullish(a) || nullish(b)) return nullish(a) && nullish(b);
  auto numeric = [](const Value& v) { return v.IsNumber() || v.kind == Value::Kind::kBool; };
  if (numeric(a) && numeric(b)) {
    auto as_double = [](const Value& v) { return v.kind == Value::Kind::kBool ? (v.boolean ? 1.0 : 0.0) : v.AsDouble(); };
    if (a.kind == Value::Kind::kInt && b.kind == Value::Kind::kInt) return a.integer == b.integer;
    return as_double(a) == as_double(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::kString: return a.string == b.string;
    case Value::Kind::kArray: return a.array == b.array;
    case Value::Kind::kObject:
    case Value::Kind::kNamespace: return a.object == b.object;
    case Value::Kind::kFunction: return a.function == b.function;
    default: return false;
  }
}

}  // namespace duet::jinja
