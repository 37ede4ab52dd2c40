#include "twobp/files.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
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
  if (!tmp.empty()) ::unlink(tmp.c_str());
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

namespace {

// The file a write to `path` lands in: `path` itself, or where its chain of symbolic links ends (relative targets
// read from the link's directory), so that the link survives and its target is replaced.
std::string follow_links(const std::string& path, const std::string& what = "output") {
  std::string current = path;
  for (int depth = 0; depth < 40; ++depth) {  // Linux's own limit on links followed (ELOOP)
    struct stat st;
    if (::lstat(current.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return current;
    std::string target(PATH_MAX, '\0');
    const ssize_t n = ::readlink(current.c_str(), target.data(), target.size());
    TWOBP_CHECK(n > 0, IOError, "{}: cannot read the symbolic link {}: {}", what, current, std::strerror(errno));
    target.resize(static_cast<std::size_t>(n));
    current = target.front() == '/' ? target : parent_of(current) + "/" + target;
  }
  detail::raise<IOError>("{}: {}: more than 40 symbolic links in a chain (a loop?)", what, path);
}

// Opens an existing FIFO for writing, waiting up to `timeout_s` for a reader (a plain open would block forever).
int open_fifo(const std::string& path, const std::string& what, int timeout_s) {
  for (int waited_ms = 0;; waited_ms += 50) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd >= 0) {
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // the writes block, as they would on a pipe
      return fd;
    }
    TWOBP_CHECK(errno == ENXIO && waited_ms < timeout_s * 1000, IOError, "{}: {}: {}", what, path,
                errno == ENXIO ? fmt::format("no reader opened the FIFO within {} s", timeout_s)
                               : std::string(std::strerror(errno)));
    ::usleep(50 * 1000);
  }
}

// Writes every byte to `fd`; on failure closes it, removes `tmp` (when not empty) and throws.
void write_all(int fd, const std::string& bytes, const std::string& name, const std::string& tmp,
               const std::string& what) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(fd, tmp, what, fmt::format("writing {} failed at offset {}", name, done));
    done += static_cast<std::size_t>(n);
  }
}

// A device node or a FIFO is written in place (never renamed over: the node is the system's, and /dev/null or
// /dev/stdout must stay what they are); every write and the close are checked, so /dev/full fails with ENOSPC.
void write_in_place(const std::string& path, const struct stat& st, const std::string& bytes,
                    const std::string& what) {
  const int fd = S_ISFIFO(st.st_mode) ? open_fifo(path, what, /*timeout_s=*/30)
                                      : ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) fail(-1, "", what, fmt::format("cannot open {} for writing", path));
  write_all(fd, bytes, path, "", what);
  if (::close(fd) != 0) fail(-1, "", what, fmt::format("closing {} failed", path));
}

}  // namespace

std::string final_target(const std::string& path) { return follow_links(path); }

bool rewritable(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode);
}

void write_file(const std::string& path, const std::string& bytes, const std::string& what, bool durable) {
  const std::string target = follow_links(path, what);
  struct stat st;
  if (::stat(target.c_str(), &st) == 0) {
    TWOBP_CHECK(!S_ISDIR(st.st_mode), IOError, "{}: {} is a directory; name a file in it", what, target);
    TWOBP_CHECK(!S_ISSOCK(st.st_mode), IOError, "{}: {} is a socket; name a file", what, target);
    if (!S_ISREG(st.st_mode)) return write_in_place(target, st, bytes, what);
  }
  const std::string tmp = target + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(-1, tmp, what, fmt::format("cannot create {}", tmp));
  write_all(fd, bytes, tmp, tmp, what);
  if (durable && ::fsync(fd) != 0) fail(fd, tmp, what, fmt::format("fsync of {} failed", tmp));
  if (::close(fd) != 0) fail(-1, tmp, what, fmt::format("closing {} failed", tmp));
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    fail(-1, tmp, what, fmt::format("renaming {} to {} failed", tmp, target));
  }
  if (!durable) return;
  const int dfd = ::open(parent_of(target).c_str(), O_RDONLY | O_DIRECTORY);  // the rename itself made durable
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace twobp
