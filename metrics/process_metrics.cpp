#include "metrics/process_metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace duet::metrics {
namespace {

void Append(std::string& out, const char* name, const char* type, const char* help, double value) {
  absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n", name, " ");
  char number[64];
  std::snprintf(number, sizeof(number), "%.17g", value);
  absl::StrAppend(&out, number, "\n");
}

// Fields of /proc/self/stat after the command name (which may hold spaces): field 3 is index 0.
std::vector<std::string> StatFields() {
  std::ifstream in("/proc/self/stat");
  std::string line;
  std::getline(in, line);
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return {};
  return absl::StrSplit(line.substr(close + 2), ' ');
}

double BootTimeSeconds() {
  std::ifstream in("/proc/stat");
  std::string key;
  double value = 0;
  while (in >> key) {
    if (key == "btime" && in >> value) return value;
    in.ignore(1 << 20, '\n');
  }
  return -1;
}

int OpenFds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int count = 0;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count - 1;  // the directory stream's own descriptor
}

}  // namespace

std::string RenderProcessMetrics() {
  std::string out;
  const std::vector<std::string> stat = StatFields();
  const double ticks = double(sysconf(_SC_CLK_TCK));
  const double page = double(sysconf(_SC_PAGESIZE));
  // stat field 14 utime, 15 stime, 22 starttime (ticks after boot), 23 vsize, 24 rss (pages).
  if (stat.size() > 22 && ticks > 0) {
    Append(out, "process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.",
           (std::stod(stat[11]) + std::stod(stat[12])) / ticks);
    Append(out, "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", std::stod(stat[20]));
    Append(out, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.",
           std::stod(stat[21]) * page);
    if (const double boot = BootTimeSeconds(); boot >= 0) {
      Append(out, "process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.",
             boot + std::stod(stat[19]) / ticks);
    }
  }
  if (const int fds = OpenFds(); fds >= 0) {
    Append(out, "process_open_fds", "gauge", "Number of open file descriptors.", fds);
  }
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    Append(out, "process_max_fds", "gauge", "Maximum number of open file descriptors.", double(limit.rlim_cur));
  }
  return out;
}

}  // namespace duet::metrics
