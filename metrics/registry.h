// A small Prometheus metrics registry: counters, gauges and fixed-bucket histograms, grouped in
// labelled families, rendered in the text exposition format 0.0.4.
//
//   duet::metrics::Registry registry;
//   auto& tokens = registry.AddCounter("duet:prompt_tokens_total", "Prefill tokens.",
//                                      {"model_name", "role"});
//   tokens.WithLabels({"tiny", "prefill"}).Inc(17);
//   std::string text = registry.Render();   // serve with HttpExporter
//
// Rules (all checked with DUET_CHECK, since breaking them is a bug in the caller, not bad input):
// metric names match [a-zA-Z_:][a-zA-Z0-9_:]*, label names [a-zA-Z_][a-zA-Z0-9_]* without a
// leading "__", histograms may not use the label "le", bucket bounds are finite and strictly
// increasing, WithLabels gets exactly one value per label name. Registering a name twice returns
// the existing family when type, help, label names (and buckets) are identical, and aborts
// otherwise, so several components may each declare the metrics they share.
//
// Output order is stable: families sorted by name (byte order), and within a family the children
// sorted by their label values. A family without labels always has its one child (value 0 until
// touched); a labelled family shows only the label sets that were asked for with WithLabels.
//
// Thread safety: every method may be called from any thread. Counter and gauge updates are
// lock-free atomics; a histogram observation takes the histogram's own mutex so that a scrape
// always sees buckets, _sum and _count from the same instant. Children live as long as the
// registry, so references returned by WithLabels may be cached.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace duet::metrics {

enum class MetricType { kCounter, kGauge, kHistogram };

// A monotonically increasing value. Inc ignores negative and NaN amounts (a counter never goes
// down); +Inf is accepted and sticks.
class Counter {
 public:
  void Inc(double amount = 1.0);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down.
class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Inc(double amount = 1.0);
  void Dec(double amount = 1.0) { Inc(-amount); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Observations counted into fixed buckets (upper bounds, inclusive: an observation v lands in
// the first bucket with v <= bound) plus the implicit +Inf bucket, with their sum and count.
// NaN observations are ignored.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);

  struct Snapshot {
    std::vector<double> bounds;          // without +Inf
    std::vector<uint64_t> cumulative;    // bounds.size() + 1 entries; the last is +Inf == count
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot Collect() const;
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  const std::vector<double> bounds_;
  mutable absl::Mutex mu_;
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);  // per bucket, not cumulative; +Inf last
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

// Everything a family shares, independent of the metric type.
class FamilyBase {
 public:
  FamilyBase(std::string name, std::string help, MetricType type, std::vector<std::string> labels,
             std::vector<double> buckets);
  virtual ~FamilyBase() = default;
  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  const std::vector<double>& buckets() const { return buckets_; }
  // Appends this family's HELP, TYPE and sample lines to `out`.
  virtual void Render(std::string& out) const = 0;

 private:
  const std::string name_;
  const std::string help_;
  const MetricType type_;
  const std::vector<std::string> label_names_;
  const std::vector<double> buckets_;  // histograms only
};

template <typename T>
class Family final : public FamilyBase {
 public:
  using FamilyBase::FamilyBase;
  // The child for these label values (in label-name order), created on first use.
  T& WithLabels(const std::vector<std::string>& values);
  void Render(std::string& out) const override;

 private:
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<T>> children_ ABSL_GUARDED_BY(mu_);
};

class Registry {
 public:
  Family<Counter>& AddCounter(std::string_view name, std::string_view help,
                              const std::vector<std::string>& label_names = {});
  Family<Gauge>& AddGauge(std::string_view name, std::string_view help,
                          const std::vector<std::string>& label_names = {});
  Family<Histogram>& AddHistogram(std::string_view name, std::string_view help,
                                  const std::vector<std::string>& label_names,
                                  const std::vector<double>& buckets);
  // The whole registry in text exposition format 0.0.4.
  std::string Render() const;

 private:
  FamilyBase& Add(std::string_view name, std::string_view help, MetricType type,
                  const std::vector<std::string>& label_names, const std::vector<double>& buckets);
  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<FamilyBase>, std::less<>> families_ ABSL_GUARDED_BY(mu_);
};

// The Content-Type of Render()'s output.
inline constexpr std::string_view kExpositionContentType = "text/plain; version=0.0.4; charset=utf-8";

// Formatting helpers, exposed for tests.
// A sample value: integral values up to 2^53 without a fraction ("42", "-3"), others in the
// shortest form that reads back exactly ("0.25", "1e-05"); "NaN", "+Inf", "-Inf".
std::string FormatValue(double value);
// A bucket bound for the le label, as Python's prometheus_client (hence vLLM) writes it:
// integral bounds keep ".0" ("1.0", "2560.0"), so Duet's series match vLLM's exactly.
std::string FormatBucketBound(double bound);
std::string EscapeLabelValue(std::string_view value);  // \ " and newline
std::string EscapeHelp(std::string_view help);         // \ and newline
bool IsValidMetricName(std::string_view name);
bool IsValidLabelName(std::string_view name);

}  // namespace duet::metrics
