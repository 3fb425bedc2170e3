#include "metrics/process_metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <ctime>
#include <regex>
#include <string>

#include "gtest/gtest.h"

namespace duet::metrics {
namespace {

double Sample(const std::string& text, const std::string& name) {
  std::smatch m;
  if (!std::regex_search(text, m, std::regex("\n" + name + " ([0-9.e+-]+)\n"))) return -1;
  return std::stod(m[1]);
}

TEST(ProcessMetricsTest, EveryFamilyWithAPlausibleValue) {
  const std::string text = "\n" + RenderProcessMetrics();
  for (const char* name : {"process_cpu_seconds_total", "process_virtual_memory_bytes",
                           "process_resident_memory_bytes", "process_start_time_seconds", "process_open_fds",
                           "process_max_fds"}) {
    EXPECT_NE(text.find(std::string("\n# TYPE ") + name + " "), std::string::npos) << name;
  }
  EXPECT_NE(text.find("# TYPE process_cpu_seconds_total counter\n"), std::string::npos);
  EXPECT_GT(Sample(text, "process_resident_memory_bytes"), 1 << 20);
  EXPECT_GE(Sample(text, "process_virtual_memory_bytes"), Sample(text, "process_resident_memory_bytes"));
  EXPECT_GE(Sample(text, "process_cpu_seconds_total"), 0);
  const double start = Sample(text, "process_start_time_seconds");
  EXPECT_LE(start, double(std::time(nullptr)) + 1);
  EXPECT_GT(start, double(std::time(nullptr)) - 3600);
}

TEST(ProcessMetricsTest, OpenFdsFollowDescriptors) {
  const double before = Sample("\n" + RenderProcessMetrics(), "process_open_fds");
  const int fd = open("/dev/null", O_RDONLY);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(Sample("\n" + RenderProcessMetrics(), "process_open_fds"), before + 1);
  close(fd);
}

}  // namespace
}  // namespace duet::metrics
