#include "metrics/registry.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "common/check.h"

namespace duet::metrics {
namespace {

void AtomicAdd(std::atomic<double>& target, double amount) {
  double current = target.load(std::memory_order_relaxed);
  while (!target.compare_exchange_weak(current, current + amount, std::memory_order_relaxed)) {
  }
}

const char* TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

// The shortest text that reads back as `value` (finite), laid out like Python's repr(): plain
// digits for decimal exponents -4..15 ("0.0001", "2560.0" before the caller trims it), scientific
// otherwise ("1e-05", "1e+16"). Python's layout keeps Duet's le labels identical to vLLM's.
std::string ShortestRepr(double value) {
  char buffer[64];
  auto result = std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::scientific);
  DUET_CHECK(result.ec == std::errc());
  std::string_view sci(buffer, result.ptr - buffer);  // e.g. "-1.2345e-04"
  size_t e = sci.find('e');
  DUET_CHECK(e != std::string_view::npos);
  int exponent = std::atoi(std::string(sci.substr(e + 1)).c_str());
  std::string sign = sci[0] == '-' ? "-" : "";
  std::string digits;
  for (char c : sci.substr(sign.size(), e - sign.size())) {
    if (c != '.') digits += c;
  }
  std::string out = sign;
  if (exponent < -4 || exponent >= 16) {
    out += digits[0];
    if (digits.size() > 1) out += "." + digits.substr(1);
    char exp_text[16];
    std::snprintf(exp_text, sizeof(exp_text), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += exp_text;
  } else if (exponent < 0) {
    out += "0." + std::string(-exponent - 1, '0') + digits;
  } else if (static_cast<int>(digits.size()) <= exponent + 1) {
    out += digits + std::string(exponent + 1 - digits.size(), '0') + ".0";
  } else {
    out += digits.substr(0, exponent + 1) + "." + digits.substr(exponent + 1);
  }
  return out;
}

// `{a="x",b="y"}` (or `{a="x",le="0.5"}`), empty when there are no labels at all.
void AppendLabels(std::string& out, const std::vector<std::string>& names,
                  const std::vector<std::string>& values, std::string_view extra_name = {},
                  std::string_view extra_value = {}) {
  if (names.empty() && extra_name.empty()) return;
  out += '{';
  bool first = true;
  for (size_t i = 0; i < names.size(); ++i) {
    if (!first) out += ',';
    first = false;
    out += names[i];
    out += "=\"";
    out += EscapeLabelValue(values[i]);
    out += '"';
  }
  if (!extra_name.empty()) {
    if (!first) out += ',';
    out += extra_name;
    out += "=\"";
    out += extra_value;
    out += '"';
  }
  out += '}';
}

void AppendHeader(std::string& out, const FamilyBase& family) {
  out += "# HELP ";
  out += family.name();
  out += ' ';
  out += EscapeHelp(family.help());
  out += "\n# TYPE ";
  out += family.name();
  out += ' ';
  out += TypeName(family.type());
  out += '\n';
}

}  // namespace

std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  if (value == std::floor(value) && std::fabs(value) <= 9007199254740992.0) {
    char buffer[32];
    std::snprintf(buffer, sizeof(buffer), "%.0f", value);
    // -0 prints as "-0"; Prometheus reads it fine but "0" is what a reader expects.
    if (std::string_view(buffer) == "-0") return "0";
    return buffer;
  }
  return ShortestRepr(value);
}

std::string FormatBucketBound(double bound) {
  if (std::isinf(bound)) return bound > 0 ? "+Inf" : "-Inf";
  return ShortestRepr(bound);
}

std::string EscapeLabelValue(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '"':
        out += "\\\"";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string EscapeHelp(std::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

bool IsValidMetricName(std::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    char c = name[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
              (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

bool IsValidLabelName(std::string_view name) {
  if (name.empty() || name.substr(0, 2) == "__") return false;
  for (size_t i = 0; i < name.size(); ++i) {
    char c = name[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
              (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

void Counter::Inc(double amount) {
  if (!(amount >= 0)) return;  // negative or NaN
  AtomicAdd(value_, amount);
}

void Gauge::Inc(double amount) { AtomicAdd(value_, amount); }

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double value) {
  if (std::isnan(value)) return;
  size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  absl::MutexLock lock(&mu_);
  ++counts_[bucket];
  sum_ += value;
  ++count_;
}

Histogram::Snapshot Histogram::Collect() const {
  Snapshot snapshot;
  snapshot.bounds = bounds_;
  absl::MutexLock lock(&mu_);
  snapshot.cumulative.reserve(counts_.size());
  uint64_t running = 0;
  for (uint64_t c : counts_) {
    running += c;
    snapshot.cumulative.push_back(running);
  }
  snapshot.sum = sum_;
  snapshot.count = count_;
  return snapshot;
}

FamilyBase::FamilyBase(std::string name, std::string help, MetricType type,
                       std::vector<std::string> labels, std::vector<double> buckets)
    : name_(std::move(name)),
      help_(std::move(help)),
      type_(type),
      label_names_(std::move(labels)),
      buckets_(std::move(buckets)) {}

template <typename T>
T& Family<T>::WithLabels(const std::vector<std::string>& values) {
  DUET_CHECK_MSG(values.size() == label_names().size(), name().c_str());
  absl::MutexLock lock(&mu_);
  auto it = children_.find(values);
  if (it == children_.end()) {
    std::unique_ptr<T> child;
    if constexpr (std::is_same_v<T, Histogram>) {
      child = std::make_unique<Histogram>(buckets());
    } else {
      child = std::make_unique<T>();
    }
    it = children_.emplace(values, std::move(child)).first;
  }
  return *it->second;
}

template <typename T>
void Family<T>::Render(std::string& out) const {
  AppendHeader(out, *this);
  absl::MutexLock lock(&mu_);
  for (const auto& [values, child] : children_) {
    if constexpr (std::is_same_v<T, Histogram>) {
      Histogram::Snapshot snap = child->Collect();
      for (size_t i = 0; i < snap.cumulative.size(); ++i) {
        out += name();
        out += "_bucket";
        std::string le = i < snap.bounds.size() ? FormatBucketBound(snap.bounds[i]) : "+Inf";
        AppendLabels(out, label_names(), values, "le", le);
        out += ' ';
        out += FormatValue(static_cast<double>(snap.cumulative[i]));
        out += '\n';
      }
      out += name();
      out += "_sum";
      AppendLabels(out, label_names(), values);
      out += ' ';
      out += FormatValue(snap.sum);
      out += '\n';
      out += name();
      out += "_count";
      AppendLabels(out, label_names(), values);
      out += ' ';
      out += FormatValue(static_cast<double>(snap.count));
      out += '\n';
    } else {
      out += name();
      AppendLabels(out, label_names(), values);
      out += ' ';
      out += FormatValue(child->Value());
      out += '\n';
    }
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

FamilyBase& Registry::Add(std::string_view name, std::string_view help, MetricType type,
                          const std::vector<std::string>& label_names,
                          const std::vector<double>& buckets) {
  std::string name_str(name);
  DUET_CHECK_MSG(IsValidMetricName(name), name_str.c_str());
  for (size_t i = 0; i < label_names.size(); ++i) {
    DUET_CHECK_MSG(IsValidLabelName(label_names[i]), label_names[i].c_str());
    DUET_CHECK_MSG(type != MetricType::kHistogram || label_names[i] != "le", name_str.c_str());
    for (size_t j = 0; j < i; ++j) DUET_CHECK_MSG(label_names[i] != label_names[j], name_str.c_str());
  }
  if (type == MetricType::kHistogram) {
    for (size_t i = 0; i < buckets.size(); ++i) {
      DUET_CHECK_MSG(std::isfinite(buckets[i]), name_str.c_str());
      DUET_CHECK_MSG(i == 0 || buckets[i - 1] < buckets[i], name_str.c_str());
    }
  }

  absl::MutexLock lock(&mu_);
  auto it = families_.find(name);
  if (it != families_.end()) {
    const FamilyBase& existing = *it->second;
    DUET_CHECK_MSG(existing.type() == type && existing.help() == help &&
                       existing.label_names() == label_names && existing.buckets() == buckets,
                   ("metric registered twice with different definitions: " + name_str).c_str());
    return *it->second;
  }
  std::unique_ptr<FamilyBase> family;
  switch (type) {
    case MetricType::kCounter:
      family = std::make_unique<Family<Counter>>(name_str, std::string(help), type, label_names,
                                                 std::vector<double>{});
      break;
    case MetricType::kGauge:
      family = std::make_unique<Family<Gauge>>(name_str, std::string(help), type, label_names,
                                               std::vector<double>{});
      break;
    case MetricType::kHistogram:
      family = std::make_unique<Family<Histogram>>(name_str, std::string(help), type, label_names,
                                                   buckets);
      break;
  }
  FamilyBase& ref = *family;
  families_.emplace(name_str, std::move(family));
  return ref;
}

Family<Counter>& Registry::AddCounter(std::string_view name, std::string_view help,
                                      const std::vector<std::string>& label_names) {
  auto& family = static_cast<Family<Counter>&>(
      Add(name, help, MetricType::kCounter, label_names, {}));
  if (label_names.empty()) family.WithLabels({});
  return family;
}

Family<Gauge>& Registry::AddGauge(std::string_view name, std::string_view help,
                                  const std::vector<std::string>& label_names) {
  auto& family =
      static_cast<Family<Gauge>&>(Add(name, help, MetricType::kGauge, label_names, {}));
  if (label_names.empty()) family.WithLabels({});
  return family;
}

Family<Histogram>& Registry::AddHistogram(std::string_view name, std::string_view help,
                                          const std::vector<std::string>& label_names,
                                          const std::vector<double>& buckets) {
  auto& family = static_cast<Family<Histogram>&>(
      Add(name, help, MetricType::kHistogram, label_names, buckets));
  if (label_names.empty()) family.WithLabels({});
  return family;
}

std::string Registry::Render() const {
  std::string out;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, family] : families_) family->Render(out);
  return out;
}

}  // namespace duet::metrics
