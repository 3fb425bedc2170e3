// The process_* metrics every Prometheus client library exports (client_golang's and
// client_python's names and types): CPU seconds, resident and virtual memory, open and maximum
// file descriptors, start time. Read from /proc/self at scrape time; HttpExporter appends them to
// every role's exposition, so dashboards and alerts on memory growth or fd leaks work as usual.
#pragma once

#include <string>

namespace duet::metrics {

// The text exposition (format 0.0.4) of this process's process_* metrics; families this kernel
// does not report are left out.
std::string RenderProcessMetrics();

}  // namespace duet::metrics
