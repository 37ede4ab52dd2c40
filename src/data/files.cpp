#include "twobp/files.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "twobp/error.h"
#include "util/check.h"

namespace twobp {
namespace {

std::string parent_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

// Closes `fd`, removes the temporary and throws "<what>: <message>: <errno's text>".
[[noreturn]] void fail(int fd, const std::string& tmp, const std::string& what, const std::string& message) {
  const int err = errno;
  if (fd >= 0) ::close(fd);
  ::unlink(tmp.c_str());
  throw IOError(fmt::format("{}: {}: {}", what, message, std::strerror(err)));
}

}  // namespace

void make_directories(const std::string& dir) {
  for (std::size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    const std::string partial = dir.substr(0, pos);
    struct stat st;
    if (::stat(partial.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) continue;
    TWOBP_CHECK(::mkdir(partial.c_str(), 0755) == 0 || errno == EEXIST, IOError, "cannot create directory {}: {}",
                partial, std::strerror(errno));
    TWOBP_CHECK(::stat(partial.c_str(), &st) == 0 && S_ISDIR(st.st_mode), IOError,
                "cannot create directory {}: a file of that name is in the way", partial);
  }
}

void write_file(const std::string& path, const std::string& bytes, const std::string& what, bool durable) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(-1, tmp, what, fmt::format("cannot create {}", tmp));
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(fd, tmp, what, fmt::format("writing {} failed at offset {}", tmp, done));
    done += static_cast<std::size_t>(n);
  }
  if (durable && ::fsync(fd) != 0) fail(fd, tmp, what, fmt::format("fsync of {} failed", tmp));
  if (::close(fd) != 0) fail(-1, tmp, what, fmt::format("closing {} failed", tmp));
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail(-1, tmp, what, fmt::format("renaming {} to {} failed", tmp, path));
  if (!durable) return;
  const int dfd = ::open(parent_of(path).c_str(), O_RDONLY | O_DIRECTORY);  // the rename itself made durable
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace twobp
