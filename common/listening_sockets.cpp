#include "common/listening_sockets.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>

namespace duet {
namespace {

// The inodes of the sockets among `pid`'s open files.
std::vector<std::string> SocketInodes(pid_t pid) {
  std::vector<std::string> inodes;
  const std::string fd_dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* dir = opendir(fd_dir.c_str());
  if (dir == nullptr) return inodes;
  while (dirent* e = readdir(dir)) {
    char target[256];
    const ssize_t n = readlink((fd_dir + "/" + e->d_name).c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    const std::string link(target, size_t(n));
    if (link.rfind("socket:[", 0) == 0) inodes.push_back(link.substr(8, link.size() - 9));
  }
  closedir(dir);
  return inodes;
}

}  // namespace

std::vector<std::string> ListeningTcpAddresses(pid_t pid) {
  const std::vector<std::string> inodes = SocketInodes(pid);
  std::vector<std::string> out;
  for (const char* table : {"tcp", "tcp6"}) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/net/" + table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
      if (state != "0A" || std::find(inodes.begin(), inodes.end(), inode) == inodes.end()) continue;  // LISTEN
      const size_t colon = local.find(':');
      if (colon == std::string::npos) continue;
      const std::string hex = local.substr(0, colon);
      if (hex.size() != 8 && hex.size() != 32) continue;
      const int port = std::stoi(local.substr(colon + 1), nullptr, 16);
      unsigned char bytes[16];
      for (size_t word = 0; word < hex.size() / 8; ++word) {  // 32-bit words in host (little-endian) order
        const uint32_t v = uint32_t(std::stoul(hex.substr(word * 8, 8), nullptr, 16));
        std::memcpy(bytes + 4 * word, &v, 4);
      }
      char text[INET6_ADDRSTRLEN];
      inet_ntop(hex.size() == 8 ? AF_INET : AF_INET6, bytes, text, sizeof(text));
      out.push_back(std::string(text) + ":" + std::to_string(port));
    }
  }
  return out;
}

}  // namespace duet
