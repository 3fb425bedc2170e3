#include "frontend/chat_template/chat_template_eval.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "frontend/chat_template/chat_template_lexer.h"

namespace duet::jinja {
namespace {

using Kind = Value::Kind;

[[noreturn]] void Fail(const std::string& message) { throw TemplateError{message}; }

// raise_exception(...) from the template itself: its message is shown as is.
struct RaisedException {
  std::string message;
};
struct BreakSignal {};
struct ContinueSignal {};

// The UTF-8 characters of s (malformed bytes stand alone), for indexing, slicing and length.
std::vector<std::string> Characters(const std::string& s) {
  std::vector<std::string> chars;
  for (size_t i = 0; i < s.size();) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    size_t length = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
    length = std::min(length, s.size() - i);
    chars.push_back(s.substr(i, length));
    i += length;
  }
  return chars;
}

std::string Trim(const std::string& s, const std::optional<std::string>& chars, bool left, bool right) {
  auto strip = [&](char c) { return chars ? chars->find(c) != std::string::npos : IsSpace(c); };
  size_t begin = 0, end = s.size();
  if (left) {
    while (begin < end && strip(s[begin])) ++begin;
  }
  if (right) {
    while (end > begin && strip(s[end - 1])) --end;
  }
  return s.substr(begin, end - begin);
}

std::string ReplaceAll(const std::string& s, const std::string& from, const std::string& to, int64_t count,
                       size_t max_bytes) {
  std::string out;
  size_t pos = 0;
  int64_t done = 0;
  auto budget = [&] {
    if (out.size() > max_bytes) Fail("replace: result too large");
  };
  if (from.empty()) {  // Python inserts `to` around every character
    for (const std::string& ch : Characters(s)) {
      if (count < 0 || done < count) {
        out += to;
        ++done;
      }
      out += ch;
      budget();
    }
    if (count < 0 || done < count) out += to;
    return out;
  }
  while (count < 0 || done < count) {
    size_t found = s.find(from, pos);
    if (found == std::string::npos) break;
    out.append(s, pos, found - pos);
    out += to;
    pos = found + from.size();
    ++done;
    budget();
  }
  out.append(s, pos, std::string::npos);
  return out;
}

std::string Capitalize(std::string s) {
  if (!s.empty()) s[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(s[0])));
  return s;
}

// JavaScript's replace(/\b\w/g, upper): the first word character of every word is upper-cased.
std::string Title(std::string s) {
  auto word = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (size_t i = 0; i < s.size(); ++i) {
    if (word(s[i]) && (i == 0 || !word(s[i - 1]))) {
      s[i] = static_cast<char>(std::toupper(static_cast<unsigned char>(s[i])));
    }
  }
  return s;
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string Upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// Python's str.split(sep=None, maxsplit=-1).
Array Split(const std::string& s, const Value& sep, int64_t max_split) {
  Array parts;
  if (sep.kind == Kind::kNone || sep.IsUndefined()) {
    size_t i = 0;
    while (true) {
      while (i < s.size() && IsSpace(s[i])) ++i;
      if (i >= s.size()) break;
      if (max_split >= 0 && static_cast<int64_t>(parts.size()) >= max_split) {
        parts.push_back(Value::String(Trim(s.substr(i), std::nullopt, false, true)));
        break;
      }
      size_t end = i;
      while (end < s.size() && !IsSpace(s[end])) ++end;
      parts.push_back(Value::String(s.substr(i, end - i)));
      i = end;
    }
    return parts;
  }
  if (sep.kind != Kind::kString) Fail("split: separator must be a string or none");
  if (sep.string.empty()) Fail("split: empty separator");
  size_t pos = 0;
  while (max_split < 0 || static_cast<int64_t>(parts.size()) < max_split) {
    size_t found = s.find(sep.string, pos);
    if (found == std::string::npos) break;
    parts.push_back(Value::String(s.substr(pos, found - pos)));
    pos = found + sep.string.size();
  }
  parts.push_back(Value::String(s.substr(pos)));
  return parts;
}

// Python slice semantics over n items; returns the selected indices.
std::vector<int64_t> SliceIndices(int64_t n, const Value& start_v, const Value& stop_v, const Value& step_v) {
  for (const Value* v : {&start_v, &stop_v, &step_v}) {
    if (v->kind != Kind::kInt && !v->IsUndefined() && v->kind != Kind::kNone) Fail("slice indices must be integers");
  }
  int64_t step = step_v.kind == Kind::kInt ? step_v.integer : 1;
  if (step == 0) Fail("slice step cannot be zero");
  auto clamp = [&](const Value& v, int64_t fallback, int64_t low, int64_t high) {
    if (v.kind != Kind::kInt) return fallback;
    int64_t i = v.integer < 0 ? v.integer + n : v.integer;
    return std::clamp(i, low, high);
  };
  int64_t start, stop;
  if (step > 0) {
    start = clamp(start_v, 0, 0, n);
    stop = clamp(stop_v, n, 0, n);
  } else {
    start = clamp(start_v, n - 1, -1, n - 1);
    stop = clamp(stop_v, -1, -1, n - 1);
  }
  std::vector<int64_t> indices;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) indices.push_back(i);
  return indices;
}

std::string StrftimeNow(const std::string& format) {
  std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buf[256];
  size_t n = std::strftime(buf, sizeof(buf), format.c_str(), &local);
  return std::string(buf, n);
}

const Value* FindKeyword(const CallArgs& args, std::string_view name) {
  for (const auto& [key, value] : args.keyword) {
    if (key == name) return &value;
  }
  return nullptr;
}

// The i-th positional argument, else the keyword `name`, else the fallback.
Value Arg(const CallArgs& args, size_t i, std::string_view name, Value fallback = Value()) {
  if (i < args.positional.size()) return args.positional[i];
  if (const Value* v = FindKeyword(args, name)) return *v;
  return fallback;
}

// The keyword argument `name`, else the fallback.
Value Keyword(const CallArgs& args, std::string_view name, Value fallback) {
  const Value* v = FindKeyword(args, name);
  return v ? *v : fallback;
}

const std::string& ExpectString(const Value& v, const std::string& what) {
  if (v.kind != Kind::kString) Fail(absl::StrCat(what, " must be a string, got ", v.TypeName()));
  return v.string;
}

int64_t ExpectInt(const Value& v, const std::string& what) {
  if (v.kind == Kind::kBool) return v.boolean ? 1 : 0;
  if (v.kind != Kind::kInt) Fail(absl::StrCat(what, " must be an integer, got ", v.TypeName()));
  return v.integer;
}

bool RunTest(const std::string& name, const Value& v) {
  if (name == "defined") return !v.IsUndefined();
  if (name == "undefined") return v.IsUndefined();
  if (name == "none") return v.kind == Kind::kNone;
  if (name == "boolean") return v.kind == Kind::kBool;
  if (name == "true") return v.kind == Kind::kBool && v.boolean;
  if (name == "false") return v.kind == Kind::kBool && !v.boolean;
  if (name == "string") return v.kind == Kind::kString;
  if (name == "number") return v.IsNumber();
  if (name == "integer") return v.kind == Kind::kInt;
  if (name == "float") return v.kind == Kind::kFloat;
  if (name == "mapping") return v.kind == Kind::kObject;
  if (name == "iterable") return v.kind == Kind::kArray || v.kind == Kind::kString || v.kind == Kind::kObject;
  if (name == "sequence") return v.kind == Kind::kArray || v.kind == Kind::kString || v.kind == Kind::kObject;
  if (name == "callable") return v.kind == Kind::kFunction;
  if (name == "odd" || name == "even") {
    if (v.kind != Kind::kInt) Fail(absl::StrCat("test '", name, "' needs an integer, got ", v.TypeName()));
    return (v.integer % 2 != 0) == (name == "odd");
  }
  if (name == "lower") return v.kind == Kind::kString && v.string == Lower(v.string);
  if (name == "upper") return v.kind == Kind::kString && v.string == Upper(v.string);
  Fail(absl::StrCat("unknown test '", name, "'"));
}

struct Scope {
  Scope* parent = nullptr;
  std::unordered_map<std::string, Value> variables;

  const Value* Lookup(const std::string& name) const {
    for (const Scope* s = this; s != nullptr; s = s->parent) {
      auto it = s->variables.find(name);
      if (it != s->variables.end()) return &it->second;
    }
    return nullptr;
  }
};

class Interpreter {
 public:
  Interpreter(const std::string& source, const RenderLimits& limits) : source_(source), limits_(limits) {}

  std::string Run(const Body& program, const nlohmann::ordered_json& context) {
    Scope globals;
    InstallGlobals(globals);
    if (!context.is_null() && !context.is_object()) Fail("the render context must be a JSON object");
    for (const auto& [key, value] : context.items()) globals.variables[key] = Value::FromJson(value);
    std::string out;
    ExecBody(program, globals, out);
    return out;
  }

  // Offset of the node being evaluated when an error surfaced.
  size_t error_offset() const { return error_offset_; }

 private:
  void Step(size_t offset) {
    error_offset_ = offset;
    if (++steps_ > limits_.max_steps) Fail("template exceeded its evaluation budget");
  }

  void CheckSize(const std::string& s) const {
    if (s.size() > limits_.max_string_bytes) Fail("template output too large");
  }

  void InstallGlobals(Scope& globals) {
    globals.variables["true"] = globals.variables["True"] = Value::Bool(true);
    globals.variables["false"] = globals.variables["False"] = Value::Bool(false);
    globals.variables["none"] = globals.variables["None"] = Value::None();
    globals.variables["raise_exception"] = Value::Function([](CallArgs& args) -> Value {
      throw RaisedException{args.positional.empty() ? "" : ToConcatString(args.positional[0])};
    });
    globals.variables["strftime_now"] = Value::Function([](CallArgs& args) {
      return Value::String(StrftimeNow(ExpectString(Arg(args, 0, "format"), "strftime_now format")));
    });
    globals.variables["range"] = Value::Function([this](CallArgs& args) {
      if (args.positional.empty() || args.positional.size() > 3) Fail("range expects 1 to 3 arguments");
      int64_t start = 0, stop, step = 1;
      if (args.positional.size() == 1) {
        stop = ExpectInt(args.positional[0], "range stop");
      } else {
        start = ExpectInt(args.positional[0], "range start");
        stop = ExpectInt(args.positional[1], "range stop");
        if (args.positional.size() == 3) step = ExpectInt(args.positional[2], "range step");
      }
      if (step == 0) Fail("range() step must not be zero");
      Array items;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (static_cast<int64_t>(items.size()) >= limits_.max_range_length) Fail("range too long");
        items.push_back(Value::Int(i));
      }
      return Value::List(std::move(items));
    });
    globals.variables["namespace"] = Value::Function([](CallArgs& args) {
      if (args.positional.size() > 1) Fail("namespace expects at most one positional argument");
      Object entries;
      auto set = [&](const std::string& key, const Value& value) {
        for (auto& entry : entries) {
          if (entry.first == key) {
            entry.second = value;
            return;
          }
        }
        entries.emplace_back(key, value);
      };
      if (!args.positional.empty()) {
        const Value& source = args.positional[0];
        if (source.kind != Kind::kObject) Fail("namespace expects a mapping");
        for (const auto& [key, value] : *source.object) set(key, value);
      }
      for (const auto& [key, value] : args.keyword) set(key, value);
      return Value::Namespace(std::move(entries));
    });
  }

  // ---- statements ----

  void ExecBody(const Body& body, Scope& scope, std::string& out) {
    for (const Node& node : body) Exec(node, scope, out);
  }

  void Exec(const Node& node, Scope& scope, std::string& out) {
    Step(node.offset);
    switch (node.type) {
      case Node::Type::kText:
        out += node.text;
        break;
      case Node::Type::kOutput:
        out += ToOutputString(Eval(*node.expr, scope));
        break;
      case Node::Type::kIf:
        ExecBody(Eval(*node.expr, scope).Truthy() ? node.body : node.alternate, scope, out);
        break;
      case Node::Type::kFor:
        ExecFor(node, scope, out);
        break;
      case Node::Type::kSet: {
        Value value;
        if (node.expr) {
          value = Eval(*node.expr, scope);
        } else {
          std::string rendered;
          ExecBody(node.body, scope, rendered);
          value = Value::String(std::move(rendered));
        }
        Assign(*node.target, std::move(value), scope);
        break;
      }
      case Node::Type::kMacro:
        scope.variables[node.text] = MakeMacro(node.text, node.params, node.body);
        break;
      case Node::Type::kCallBlock: {
        const Expr& call = *node.expr;
        Value macro = Eval(*call.children[0], scope);
        CallArgs args = EvalArguments(call, 1, scope);
        Scope with_caller{&scope, {}};
        with_caller.variables["caller"] = MakeMacro("caller", node.params, node.body);
        out += ToOutputString(CallFunction(macro, args, with_caller));
        break;
      }
      case Node::Type::kFilterBlock: {
        std::string rendered;
        ExecBody(node.body, scope, rendered);
        out += ToOutputString(ApplyFilter(Value::String(std::move(rendered)), *node.expr, scope));
        break;
      }
      case Node::Type::kBreak:
        throw BreakSignal{};
      case Node::Type::kContinue:
        throw ContinueSignal{};
    }
    CheckSize(out);
  }

  void Assign(const Expr& target, Value value, Scope& scope) {
    switch (target.type) {
      case Expr::Type::kIdentifier:
        scope.variables[target.name] = std::move(value);
        return;
      case Expr::Type::kTuple: {
        if (value.kind != Kind::kArray) Fail(absl::StrCat("cannot unpack ", value.TypeName()));
        if (value.array->size() != target.children.size()) Fail("wrong number of values to unpack");
        for (size_t i = 0; i < target.children.size(); ++i) {
          if (target.children[i]->type != Expr::Type::kIdentifier) Fail("can only unpack into names");
          scope.variables[target.children[i]->name] = (*value.array)[i];
        }
        return;
      }
      case Expr::Type::kMember: {
        Value object = Eval(*target.children[0], scope);
        if (object.kind != Kind::kNamespace) Fail("cannot assign an attribute of a non-namespace object");
        const Expr& key = *target.children[1];
        if (key.type != Expr::Type::kLiteral || key.literal.kind != Kind::kString) {
          Fail("namespace attributes are assigned by name");
        }
        for (auto& entry : *object.object) {
          if (entry.first == key.literal.string) {
            entry.second = std::move(value);
            return;
          }
        }
        object.object->emplace_back(key.literal.string, std::move(value));
        return;
      }
      default:
        Fail("invalid assignment target");
    }
  }

  void ExecFor(const Node& node, Scope& scope, std::string& out) {
    Scope loop_scope{&scope, {}};
    const Expr* iterable_expr = node.expr.get();
    const Expr* condition = nullptr;
    if (iterable_expr->type == Expr::Type::kSelect) {
      condition = iterable_expr->children[1].get();
      iterable_expr = iterable_expr->children[0].get();
    }
    Value iterable = Eval(*iterable_expr, loop_scope);
    Array candidates;
    switch (iterable.kind) {
      case Kind::kArray: candidates = *iterable.array; break;
      case Kind::kObject:
        for (const auto& entry : *iterable.object) candidates.push_back(Value::String(entry.first));
        break;
      case Kind::kString:
        for (std::string& ch : Characters(iterable.string)) candidates.push_back(Value::String(std::move(ch)));
        break;
      case Kind::kUndefined: break;  // as Jinja: an undefined iterable is empty
      default: Fail(absl::StrCat("cannot iterate over ", iterable.TypeName()));
    }
    Array items;
    for (Value& candidate : candidates) {
      Step(node.offset);
      if (condition != nullptr) {
        Scope test_scope{&loop_scope, {}};
        Assign(*node.target, candidate, test_scope);
        if (!Eval(*condition, test_scope).Truthy()) continue;
      }
      items.push_back(std::move(candidate));
    }
    bool iterated = false;
    int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n; ++i) {
      Step(node.offset);
      Object loop = {
          {"index", Value::Int(i + 1)},
          {"index0", Value::Int(i)},
          {"revindex", Value::Int(n - i)},
          {"revindex0", Value::Int(n - i - 1)},
          {"first", Value::Bool(i == 0)},
          {"last", Value::Bool(i == n - 1)},
          {"length", Value::Int(n)},
          {"previtem", i > 0 ? items[i - 1] : Value()},
          {"nextitem", i < n - 1 ? items[i + 1] : Value()},
      };
      loop_scope.variables["loop"] = Value::Dict(std::move(loop));
      Assign(*node.target, items[i], loop_scope);
      try {
        ExecBody(node.body, loop_scope, out);
      } catch (const ContinueSignal&) {
        continue;
      } catch (const BreakSignal&) {
        break;
      }
      iterated = true;
    }
    if (!iterated) ExecBody(node.alternate, loop_scope, out);
  }

  // A macro (or a call block's caller) runs in a child of the scope it is called from.
  Value MakeMacro(const std::string& name, const std::vector<ExprPtr>& params, const Body& body) {
    return Value::Function([this, name, &params, &body](CallArgs& args) {
      struct DepthGuard {
        int& depth;
        ~DepthGuard() { --depth; }
      } guard{++call_depth_};
      if (call_depth_ > limits_.max_call_depth) Fail("macro calls nested too deeply");
      Scope macro_scope{calling_scope_, {}};
      if (args.positional.size() > params.size()) {
        Fail(absl::StrCat("macro '", name, "' takes at most ", params.size(), " argument(s)"));
      }
      for (const auto& keyword : args.keyword) {
        const auto& key = keyword.first;  // a structured binding cannot be captured before clang 16
        bool known = std::any_of(params.begin(), params.end(), [&](const ExprPtr& p) { return p->name == key; });
        if (!known) Fail(absl::StrCat("macro '", name, "' has no parameter '", key, "'"));
      }
      for (size_t i = 0; i < params.size(); ++i) {
        const Expr& param = *params[i];
        Value value;
        if (i < args.positional.size()) {
          value = args.positional[i];
        } else if (const Value* keyword = FindKeyword(args, param.name)) {
          value = *keyword;
        } else if (param.type == Expr::Type::kKeyword) {
          value = Eval(*param.children[0], macro_scope);
        }
        macro_scope.variables[param.name] = std::move(value);
      }
      std::string out;
      ExecBody(body, macro_scope, out);
      return Value::String(std::move(out));
    });
  }

  Value CallFunction(const Value& fn, CallArgs& args, Scope& scope) {
    if (fn.kind != Kind::kFunction) Fail(absl::StrCat("cannot call ", fn.TypeName(), " (not a function)"));
    struct ScopeGuard {
      Scope*& current;
      Scope* saved;
      ~ScopeGuard() { current = saved; }
    } guard{calling_scope_, calling_scope_};
    calling_scope_ = &scope;
    return (*fn.function)(args);
  }

  // ---- expressions ----

  CallArgs EvalArguments(const Expr& expr, size_t first, Scope& scope) {
    CallArgs args;
    for (size_t i = first; i < expr.children.size(); ++i) {
      const Expr& argument = *expr.children[i];
      if (argument.type == Expr::Type::kKeyword) {
        if (FindKeyword(args, argument.name)) Fail(absl::StrCat("repeated keyword argument '", argument.name, "'"));
        args.keyword.emplace_back(argument.name, Eval(*argument.children[0], scope));
      } else {
        args.positional.push_back(Eval(argument, scope));
      }
    }
    return args;
  }

  Value Eval(const Expr& expr, Scope& scope) {
    Step(expr.offset);
    switch (expr.type) {
      case Expr::Type::kLiteral:
        return expr.literal;
      case Expr::Type::kIdentifier: {
        const Value* value = scope.Lookup(expr.name);
        return value ? *value : Value();
      }
      case Expr::Type::kList:
      case Expr::Type::kTuple: {
        Array items;
        for (const ExprPtr& child : expr.children) items.push_back(Eval(*child, scope));
        return Value::List(std::move(items));
      }
      case Expr::Type::kDict: {
        Object items;
        for (size_t i = 0; i + 1 < expr.children.size(); i += 2) {
          Value key = Eval(*expr.children[i], scope);
          if (key.kind != Kind::kString) Fail(absl::StrCat("dict keys must be strings, got ", key.TypeName()));
          Value value = Eval(*expr.children[i + 1], scope);
          auto it = std::find_if(items.begin(), items.end(), [&](const auto& e) { return e.first == key.string; });
          if (it != items.end()) it->second = std::move(value);
          else items.emplace_back(key.string, std::move(value));
        }
        return Value::Dict(std::move(items));
      }
      case Expr::Type::kMember:
        return Member(Eval(*expr.children[0], scope), Eval(*expr.children[1], scope));
      case Expr::Type::kSlice:
        return Slice(expr, scope);
      case Expr::Type::kCall: {
        CallArgs args = EvalArguments(expr, 1, scope);
        Value fn = Eval(*expr.children[0], scope);
        error_offset_ = expr.offset;
        return CallFunction(fn, args, scope);
      }
      case Expr::Type::kKeyword:
        Fail("unexpected keyword argument");
      case Expr::Type::kUnary:
        return Unary(expr.name, Eval(*expr.children[0], scope));
      case Expr::Type::kBinary:
        return Binary(expr, scope);
      case Expr::Type::kFilter:
        return ApplyFilter(Eval(*expr.children[0], scope), expr, scope);
      case Expr::Type::kTest: {
        bool result = RunTest(expr.name, Eval(*expr.children[0], scope));
        return Value::Bool(result != expr.negate);
      }
      case Expr::Type::kTernary:
        return Eval(*expr.children[Eval(*expr.children[0], scope).Truthy() ? 1 : 2], scope);
      case Expr::Type::kSelect:
        return Eval(*expr.children[1], scope).Truthy() ? Eval(*expr.children[0], scope) : Value();
    }
    return Value();
  }

  Value Slice(const Expr& expr, Scope& scope) {
    Value object = Eval(*expr.children[0], scope);
    Value parts[3];
    for (int i = 0; i < 3; ++i) {
      if (expr.children[i + 1]) parts[i] = Eval(*expr.children[i + 1], scope);
    }
    if (object.kind == Kind::kArray) {
      Array items;
      for (int64_t i : SliceIndices(object.array->size(), parts[0], parts[1], parts[2])) {
        items.push_back((*object.array)[i]);
      }
      return Value::List(std::move(items));
    }
    if (object.kind == Kind::kString) {
      std::vector<std::string> chars = Characters(object.string);
      std::string out;
      for (int64_t i : SliceIndices(chars.size(), parts[0], parts[1], parts[2])) out += chars[i];
      return Value::String(std::move(out));
    }
    Fail(absl::StrCat("cannot slice ", object.TypeName()));
  }

  Value Member(const Value& object, const Value& key) {
    if (object.IsMapping()) {
      if (key.kind != Kind::kString) Fail(absl::StrCat("cannot look up a ", key.TypeName(), " key in a dict"));
      if (const Value* value = object.Find(key.string)) return *value;
      return object.kind == Kind::kObject ? DictMethod(object, key.string) : Value();
    }
    if (object.kind == Kind::kArray || object.kind == Kind::kString) {
      if (key.kind == Kind::kInt) {
        if (object.kind == Kind::kArray) {
          int64_t n = object.array->size();
          int64_t i = key.integer < 0 ? key.integer + n : key.integer;
          return i >= 0 && i < n ? (*object.array)[i] : Value();
        }
        std::vector<std::string> chars = Characters(object.string);
        int64_t n = chars.size();
        int64_t i = key.integer < 0 ? key.integer + n : key.integer;
        return i >= 0 && i < n ? Value::String(chars[i]) : Value();
      }
      if (key.kind != Kind::kString) Fail(absl::StrCat("cannot index with a ", key.TypeName()));
      if (object.kind == Kind::kArray) {
        return key.string == "length" ? Value::Int(object.array->size()) : Value();
      }
      return StringMethod(object.string, key.string);
    }
    return Value();  // attributes of undefined, none, numbers: undefined, as in the reference
  }

  Value StringMethod(const std::string& s, const std::string& name) {
    if (name == "length") return Value::Int(Characters(s).size());
    auto method = [](auto fn) { return Value::Function(std::move(fn)); };
    auto strip = [s](bool left, bool right) {
      return Value::Function([s, left, right](CallArgs& args) {
        Value chars = Arg(args, 0, "chars");
        std::optional<std::string> set;
        if (chars.kind == Kind::kString) set = chars.string;
        return Value::String(Trim(s, set, left, right));
      });
    };
    if (name == "strip") return strip(true, true);
    if (name == "lstrip") return strip(true, false);
    if (name == "rstrip") return strip(false, true);
    if (name == "upper") return method([s](CallArgs&) { return Value::String(Upper(s)); });
    if (name == "lower") return method([s](CallArgs&) { return Value::String(Lower(s)); });
    if (name == "title") return method([s](CallArgs&) { return Value::String(Title(s)); });
    if (name == "capitalize") return method([s](CallArgs&) { return Value::String(Capitalize(s)); });
    if (name == "startswith" || name == "endswith") {
      bool starts = name == "startswith";
      return method([s, starts](CallArgs& args) {
        if (args.positional.empty()) Fail("startswith/endswith need an argument");
        auto matches = [&](const Value& p) {
          const std::string& affix = ExpectString(p, "startswith/endswith argument");
          if (affix.size() > s.size()) return false;
          return starts ? s.compare(0, affix.size(), affix) == 0
                        : s.compare(s.size() - affix.size(), affix.size(), affix) == 0;
        };
        const Value& pattern = args.positional[0];
        if (pattern.kind == Kind::kArray) {
          return Value::Bool(std::any_of(pattern.array->begin(), pattern.array->end(), matches));
        }
        return Value::Bool(matches(pattern));
      });
    }
    if (name == "split") {
      return method([s](CallArgs& args) {
        return Value::List(Split(s, Arg(args, 0, "sep"), ExpectInt(Arg(args, 1, "maxsplit", Value::Int(-1)), "maxsplit")));
      });
    }
    if (name == "replace") {
      return method([this, s](CallArgs& args) {
        if (args.positional.size() < 2) Fail("replace() needs two arguments");
        Value count = Arg(args, 2, "count", Value::Int(-1));
        return Value::String(ReplaceAll(s, ExpectString(args.positional[0], "replace() argument"),
                                        ExpectString(args.positional[1], "replace() argument"),
                                        count.kind == Kind::kNone ? -1 : ExpectInt(count, "replace() count"),
                                        limits_.max_string_bytes));
      });
    }
    return Value();
  }

  Value DictMethod(const Value& dict, const std::string& name) {
    auto object = dict.object;
    if (name == "get") {
      return Value::Function([object](CallArgs& args) {
        if (args.positional.empty()) Fail("get() needs a key");
        const std::string& key = ExpectString(args.positional[0], "dict key");
        for (const auto& [k, v] : *object) {
          if (k == key) return v;
        }
        return args.positional.size() > 1 ? args.positional[1] : Value::None();
      });
    }
    if (name == "items") return Value::Function([object](CallArgs&) { return Items(*object); });
    if (name == "keys") {
      return Value::Function([object](CallArgs&) {
        Array keys;
        for (const auto& entry : *object) keys.push_back(Value::String(entry.first));
        return Value::List(std::move(keys));
      });
    }
    if (name == "values") {
      return Value::Function([object](CallArgs&) {
        Array values;
        for (const auto& entry : *object) values.push_back(entry.second);
        return Value::List(std::move(values));
      });
    }
    return Value();
  }

  static Value Items(const Object& object) {
    Array items;
    for (const auto& [key, value] : object) items.push_back(Value::List({Value::String(key), value}));
    return Value::List(std::move(items));
  }

  static Value Unary(const std::string& op, const Value& operand) {
    if (op == "not") return Value::Bool(!operand.Truthy());
    int sign = op == "-" ? -1 : 1;
    if (operand.kind == Kind::kFloat) return Value::Float(sign * operand.number);
    if (operand.kind == Kind::kInt || operand.kind == Kind::kBool) {
      return Value::Int(sign * (operand.kind == Kind::kBool ? operand.boolean : operand.integer));
    }
    Fail(absl::StrCat("bad operand type for unary ", op, ": ", operand.TypeName()));
  }

  Value Binary(const Expr& expr, Scope& scope) {
    const std::string& op = expr.name;
    Value left = Eval(*expr.children[0], scope);
    if (op == "and") return left.Truthy() ? Eval(*expr.children[1], scope) : left;
    if (op == "or") return left.Truthy() ? left : Eval(*expr.children[1], scope);
    Value right = Eval(*expr.children[1], scope);
    error_offset_ = expr.offset;
    if (op == "==") return Value::Bool(LooseEquals(left, right));
    if (op == "!=") return Value::Bool(!LooseEquals(left, right));
    if (op == "in" || op == "not in") return Value::Bool(Contains(right, left) == (op == "in"));
    if (left.IsUndefined() || right.IsUndefined() || left.kind == Kind::kNone || right.kind == Kind::kNone) {
      Fail(absl::StrCat("cannot apply '", op, "' to ", left.TypeName(), " and ", right.TypeName()));
    }
    if (op == "~" || (op == "+" && (left.kind == Kind::kString || right.kind == Kind::kString))) {
      std::string joined = ToConcatString(left) + ToConcatString(right);
      CheckSize(joined);
      return Value::String(std::move(joined));
    }
    if (op == "+" && left.kind == Kind::kArray && right.kind == Kind::kArray) {
      Array items = *left.array;
      items.insert(items.end(), right.array->begin(), right.array->end());
      if (items.size() > limits_.max_string_bytes) Fail("list too large");
      return Value::List(std::move(items));
    }
    if (left.IsNumber() && right.IsNumber()) return Arithmetic(op, left, right);
    if (op == "**" && (left.kind == Kind::kBool || right.kind == Kind::kBool)) {
      Fail("'**' on booleans is not supported");
    }
    Fail(absl::StrCat("cannot apply '", op, "' to ", left.TypeName(), " and ", right.TypeName()));
  }

  static bool Contains(const Value& container, const Value& item) {
    switch (container.kind) {
      case Kind::kUndefined: return false;
      case Kind::kArray:
        return std::any_of(container.array->begin(), container.array->end(), [&](const Value& v) {
          if (v.kind == Kind::kString || item.kind == Kind::kString) {
            return v.kind == item.kind && v.string == item.string;
          }
          return (v.IsNumber() && item.IsNumber()) || v.kind == item.kind ? LooseEquals(v, item) : false;
        });
      case Kind::kString:
        if (item.kind != Kind::kString) Fail("'in <string>' needs a string on the left");
        return container.string.find(item.string) != std::string::npos;
      case Kind::kObject:
      case Kind::kNamespace:
        return item.kind == Kind::kString && container.Find(item.string) != nullptr;
      default:
        Fail(absl::StrCat("'in' needs a container on the right, got ", container.TypeName()));
    }
  }

  static Value Arithmetic(const std::string& op, const Value& left, const Value& right) {
    bool is_float = left.kind == Kind::kFloat || right.kind == Kind::kFloat;
    double a = left.AsDouble(), b = right.AsDouble();
    if (op == "<") return Value::Bool(a < b);
    if (op == ">") return Value::Bool(a > b);
    if (op == "<=") return Value::Bool(a <= b);
    if (op == ">=") return Value::Bool(a >= b);
    if (op == "/") {
      if (b == 0) Fail("division by zero");
      return Value::Float(a / b);
    }
    if (is_float) {
      if ((op == "//" || op == "%") && b == 0) Fail("division by zero");
      if (op == "+") return Value::Float(a + b);
      if (op == "-") return Value::Float(a - b);
      if (op == "*") return Value::Float(a * b);
      if (op == "//") return Value::Float(std::floor(a / b));
      if (op == "%") return Value::Float(std::fmod(a, b));
      if (op == "**") return Value::Float(std::pow(a, b));
    } else {
      int64_t x = left.integer, y = right.integer;
      int64_t r = 0;
      bool overflow = false;
      if (op == "+") overflow = __builtin_add_overflow(x, y, &r);
      if (op == "-") overflow = __builtin_sub_overflow(x, y, &r);
      if (op == "*") overflow = __builtin_mul_overflow(x, y, &r);
      if (overflow) Fail("integer overflow");
      if (op == "+" || op == "-" || op == "*") return Value::Int(r);
      if (op == "//" || op == "%") {
        if (y == 0) Fail("division by zero");
        if (x == INT64_MIN && y == -1) Fail("integer overflow");
        return op == "//" ? Value::Int(static_cast<int64_t>(std::floor(static_cast<double>(x) / y))) : Value::Int(x % y);
      }
      if (op == "**") {
        if (y < 0) return Value::Float(std::pow(a, b));
        double p = std::pow(a, b);
        if (std::fabs(p) > 9.2e18) Fail("integer overflow");
        return Value::Int(static_cast<int64_t>(p));
      }
    }
    Fail(absl::StrCat("unknown operator '", op, "'"));
  }

  // ---- filters ----

  [[noreturn]] static void FailFilter(const std::string& name, const std::string& operand_type) {
    static const std::unordered_set<std::string> kKnown = {
        "abs", "bool", "capitalize", "dictsort", "first", "indent", "items", "join", "last", "list", "lower",
        "map", "rejectattr", "replace", "reverse", "selectattr", "sort", "title", "trim", "unique", "upper"};
    if (kKnown.count(name)) Fail(absl::StrCat("cannot apply filter '", name, "' to ", operand_type));
    Fail(absl::StrCat("unknown filter '", name, "'"));
  }

  Value ApplyFilter(const Value& operand, const Expr& filter, Scope& scope) {
    CallArgs args = EvalArguments(filter, 1, scope);
    error_offset_ = filter.offset;
    const std::string& name = filter.name;
    if (name == "safe") return operand;
    if (name == "default" || name == "d") {
      Value fallback = Arg(args, 0, "default_value", Value::String(""));
      bool boolean = Arg(args, 1, "boolean", Value::Bool(false)).Truthy();
      return operand.IsUndefined() || (boolean && !operand.Truthy()) ? fallback : operand;
    }
    if (name == "tojson") return Value::String(ToJsonFilter(operand, args));
    if (name == "string") {
      return operand.kind == Kind::kString ? operand : Value::String(ToOutputString(operand));
    }
    if (name == "length" || name == "count") {
      switch (operand.kind) {
        case Kind::kString: return Value::Int(Characters(operand.string).size());
        case Kind::kArray: return Value::Int(operand.array->size());
        case Kind::kObject:
        case Kind::kNamespace: return Value::Int(operand.object->size());
        default: Fail(absl::StrCat("cannot take the length of ", operand.TypeName()));
      }
    }
    if (name == "int" || name == "float") return ToNumber(operand, name == "int", args);
    if (name == "bool" && operand.kind == Kind::kBool) return operand;
    if (name == "abs" && operand.IsNumber()) {
      return operand.kind == Kind::kInt ? Value::Int(std::llabs(operand.integer)) : Value::Float(std::fabs(operand.number));
    }
    if (operand.kind == Kind::kString) return StringFilter(operand.string, name, args);
    if (operand.kind == Kind::kArray) return ListFilter(*operand.array, name, args);
    if (operand.kind == Kind::kObject) {
      if (name == "items") return Items(*operand.object);
      if (name == "list") {
        Array keys;
        for (const auto& entry : *operand.object) keys.push_back(Value::String(entry.first));
        return Value::List(std::move(keys));
      }
      if (name == "dictsort") return ListFilter(*Items(*operand.object).array, "sort", args);
    }
    FailFilter(name, operand.TypeName());
  }

  std::string ToJsonFilter(const Value& operand, const CallArgs& args) {
    JsonOptions options;
    Value indent = Arg(args, 0, "indent", Value::None());
    if (indent.kind != Kind::kNone) options.indent = static_cast<int>(std::clamp<int64_t>(ExpectInt(indent, "indent"), 0, 64));
    options.ensure_ascii = Keyword(args, "ensure_ascii", Value::Bool(false)).Truthy();
    options.sort_keys = Keyword(args, "sort_keys", Value::Bool(false)).Truthy();
    Value separators = Keyword(args, "separators", Value::None());
    if (separators.kind == Kind::kArray) {
      if (separators.array->size() != 2) Fail("separators must be two strings");
      options.item_separator = ExpectString((*separators.array)[0], "separator");
      options.key_separator = ExpectString((*separators.array)[1], "separator");
    }
    std::string json = ToJson(operand, options);
    CheckSize(json);
    return json;
  }

  static Value ToNumber(const Value& operand, bool integer, const CallArgs& args) {
    Value fallback = Arg(args, 0, "default", integer ? Value::Int(0) : Value::Float(0));
    switch (operand.kind) {
      case Kind::kInt:
      case Kind::kFloat:
        if (integer && operand.kind == Kind::kFloat) return Value::Int(static_cast<int64_t>(std::floor(operand.number)));
        if (!integer && operand.kind == Kind::kInt) return Value::Float(static_cast<double>(operand.integer));
        return operand;
      case Kind::kBool:
        return integer ? Value::Int(operand.boolean) : Value::Float(operand.boolean);
      case Kind::kString: {
        const char* begin = operand.string.c_str();
        while (IsSpace(*begin)) ++begin;
        char* end = nullptr;
        errno = 0;
        if (integer) {
          long long v = std::strtoll(begin, &end, 10);
          return end == begin || errno == ERANGE ? fallback : Value::Int(v);
        }
        double v = std::strtod(begin, &end);
        return end == begin ? fallback : Value::Float(v);
      }
      default:
        Fail(absl::StrCat("cannot convert ", operand.TypeName(), " to a number"));
    }
  }

  Value StringFilter(const std::string& s, const std::string& name, const CallArgs& args) {
    if (name == "trim") return Value::String(Trim(s, std::nullopt, true, true));
    if (name == "upper") return Value::String(Upper(s));
    if (name == "lower") return Value::String(Lower(s));
    if (name == "title") return Value::String(Title(s));
    if (name == "capitalize") return Value::String(Capitalize(s));
    if (name == "join") return Value::String(s);
    if (name == "list") {
      Array chars;
      for (std::string& ch : Characters(s)) chars.push_back(Value::String(std::move(ch)));
      return Value::List(std::move(chars));
    }
    if (name == "first" || name == "last") {
      std::vector<std::string> chars = Characters(s);
      if (chars.empty()) return Value();
      return Value::String(name == "first" ? chars.front() : chars.back());
    }
    if (name == "reverse") {
      std::vector<std::string> chars = Characters(s);
      std::string out;
      for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += *it;
      return Value::String(std::move(out));
    }
    if (name == "replace") {
      if (args.positional.size() < 2) Fail("replace needs two arguments");
      Value count = Arg(args, 2, "count", Value::Int(-1));
      return Value::String(ReplaceAll(s, ExpectString(args.positional[0], "replace argument"),
                                      ExpectString(args.positional[1], "replace argument"),
                                      count.kind == Kind::kNone ? -1 : ExpectInt(count, "replace count"),
                                      limits_.max_string_bytes));
    }
    if (name == "indent") {
      int64_t width = std::clamp<int64_t>(ExpectInt(Arg(args, 0, "width", Value::Int(4)), "indent width"), 0, 64);
      bool first = Arg(args, 1, "first", Value::Bool(false)).Truthy();
      bool blank = Arg(args, 2, "blank", Value::Bool(false)).Truthy();
      std::string pad(width, ' ');
      std::string out;
      size_t line_start = 0;
      for (size_t line = 0;; ++line) {
        size_t end = s.find('\n', line_start);
        std::string text = s.substr(line_start, end == std::string::npos ? std::string::npos : end - line_start);
        if (!((line == 0 && !first) || (text.empty() && !blank))) out += pad;
        out += text;
        if (end == std::string::npos) break;
        out += '\n';
        line_start = end + 1;
        CheckSize(out);
      }
      return Value::String(std::move(out));
    }
    FailFilter(name, "string");
  }

  Value ListFilter(const Array& items, const std::string& name, const CallArgs& args) {
    if (name == "list") return Value::List(items);
    if (name == "first") return items.empty() ? Value() : items.front();
    if (name == "last") return items.empty() ? Value() : items.back();
    if (name == "reverse") return Value::List(Array(items.rbegin(), items.rend()));
    if (name == "join") {
      Value separator = Arg(args, 0, "d", Value::String(""));
      if (const Value* keyword = FindKeyword(args, "separator")) separator = *keyword;
      const std::string& sep = ExpectString(separator, "join separator");
      std::string out;
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) out += sep;
        out += ToOutputString(items[i]);
        CheckSize(out);
      }
      return Value::String(std::move(out));
    }
    if (name == "unique") {
      Array out;
      for (const Value& item : items) {
        bool seen = std::any_of(out.begin(), out.end(), [&](const Value& v) {
          return v.kind == item.kind && LooseEquals(v, item);
        });
        if (!seen) out.push_back(item);
      }
      return Value::List(std::move(out));
    }
    if (name == "map") {
      const Value* attribute = FindKeyword(args, "attribute");
      if (attribute == nullptr) Fail("map without attribute= is not supported");
      const std::string& path = ExpectString(*attribute, "map attribute");
      const Value* fallback = FindKeyword(args, "default");
      Array out;
      for (const Value& item : items) {
        if (!item.IsMapping()) Fail("map(attribute=...) needs a list of dicts");
        Value value = AttributePath(item, path);
        out.push_back(value.IsUndefined() && fallback ? *fallback : value);
      }
      return Value::List(std::move(out));
    }
    if (name == "selectattr" || name == "rejectattr") {
      bool select = name == "selectattr";
      if (args.positional.empty()) Fail(absl::StrCat(name, " needs an attribute name"));
      const std::string& attribute = ExpectString(args.positional[0], "attribute");
      std::string test = args.positional.size() > 1 ? ExpectString(args.positional[1], "test name") : "";
      Value expected = args.positional.size() > 2 ? args.positional[2] : Value();
      Array out;
      for (const Value& item : items) {
        if (!item.IsMapping()) Fail(absl::StrCat(name, " needs a list of dicts"));
        const Value* value = item.Find(attribute);
        bool result = false;
        if (value != nullptr) {
          if (test.empty()) result = value->Truthy();
          else if (test == "equalto" || test == "eq" || test == "==") result = LooseEquals(*value, expected);
          else if (test == "ne" || test == "!=") result = !LooseEquals(*value, expected);
          else result = RunTest(test, *value);
        }
        if (result == select) out.push_back(item);
      }
      return Value::List(std::move(out));
    }
    if (name == "sort") {
      bool reverse = Arg(args, 0, "reverse", Value::Bool(false)).Truthy();
      bool case_sensitive = Arg(args, 1, "case_sensitive", Value::Bool(false)).Truthy();
      Value attribute = Arg(args, 2, "attribute", Value::None());
      auto key = [&](const Value& v) {
        if (attribute.kind == Kind::kNone) return v;
        return AttributePath(v, attribute.kind == Kind::kInt ? std::to_string(attribute.integer)
                                                              : ExpectString(attribute, "sort attribute"));
      };
      auto less = [&](const Value& a, const Value& b) {
        int c = Compare(key(a), key(b), case_sensitive);
        return reverse ? c > 0 : c < 0;
      };
      Array sorted = items;
      std::stable_sort(sorted.begin(), sorted.end(), less);
      return Value::List(std::move(sorted));
    }
    FailFilter(name, "list");
  }

  static Value AttributePath(const Value& item, const std::string& path) {
    Value value = item;
    size_t start = 0;
    while (true) {
      size_t dot = path.find('.', start);
      std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      if (value.IsMapping()) {
        const Value* found = value.Find(part);
        value = found ? *found : Value();
      } else if (value.kind == Kind::kArray && !part.empty() &&
                 std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
                 part.size() < 10 && std::stoul(part) < value.array->size()) {
        value = Value((*value.array)[std::stoul(part)]);
      } else {
        return Value();
      }
      if (dot == std::string::npos) return value;
      start = dot + 1;
    }
  }

  // Orders numbers and strings (case-insensitively unless asked); pairs element by element.
  static int Compare(const Value& a, const Value& b, bool case_sensitive) {
    if (a.kind == Kind::kNone && b.kind == Kind::kNone) return 0;
    if ((a.IsNumber() || a.kind == Kind::kBool) && (b.IsNumber() || b.kind == Kind::kBool)) {
      double x = a.kind == Kind::kBool ? a.boolean : a.AsDouble();
      double y = b.kind == Kind::kBool ? b.boolean : b.AsDouble();
      return x < y ? -1 : x > y ? 1 : 0;
    }
    if (a.kind == Kind::kString && b.kind == Kind::kString) {
      std::string x = case_sensitive ? a.string : Lower(a.string);
      std::string y = case_sensitive ? b.string : Lower(b.string);
      return x < y ? -1 : x > y ? 1 : 0;
    }
    if (a.kind == Kind::kArray && b.kind == Kind::kArray) {
      for (size_t i = 0; i < std::min(a.array->size(), b.array->size()); ++i) {
        int c = Compare((*a.array)[i], (*b.array)[i], case_sensitive);
        if (c != 0) return c;
      }
      return a.array->size() < b.array->size() ? -1 : a.array->size() > b.array->size() ? 1 : 0;
    }
    Fail(absl::StrCat("cannot compare ", a.TypeName(), " with ", b.TypeName()));
  }

  const std::string& source_;
  const RenderLimits& limits_;
  int64_t steps_ = 0;
  int call_depth_ = 0;
  size_t error_offset_ = 0;
  Scope* calling_scope_ = nullptr;
};

}  // namespace

absl::StatusOr<std::string> Render(const Body& program, const std::string& source,
                                   const nlohmann::ordered_json& context, const RenderLimits& limits) {
  Interpreter interpreter(source, limits);
  try {
    return interpreter.Run(program, context);
  } catch (const RaisedException& raised) {
    return absl::InvalidArgumentError(raised.message);
  } catch (const TemplateError& error) {
    return absl::InvalidArgumentError(absl::StrCat(
        "template error at ", DescribePosition(source, interpreter.error_offset()), ": ", error.message));
  } catch (const BreakSignal&) {
    return absl::InvalidArgumentError("'break' outside a loop");
  } catch (const ContinueSignal&) {
    return absl::InvalidArgumentError("'continue' outside a loop");
  } catch (const std::exception& error) {  // e.g. std::bad_alloc, nlohmann errors
    return absl::InternalError(absl::StrCat("template rendering failed: ", error.what()));
  }
}

}  // namespace duet::jinja
