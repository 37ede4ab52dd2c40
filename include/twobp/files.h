#pragma once
// The files a run writes -- checkpoints, token files, reports, traces -- go through one writer: whole or not at all.
//
// POSIX calls, not std::filesystem: LibTorch's wheel exports its own copies of std::filesystem symbols, which can
// bind in place of libstdc++'s in a program that links both and crash (seen in remove_all). Programs linking the
// wheel should avoid std::filesystem too, or use these.

#include <string>

namespace twobp {

/// Creates `dir` and its missing parents (mkdir -p). IOError naming the directory that could not be created and
/// the system's reason (e.g. a file in the way, no permission).
void make_directories(const std::string& dir);

/// Writes `bytes` to `path` whole or not at all: into "<path>.tmp" beside it, then renamed over `path`, so that a
/// reader, a crash or an interrupt sees the old file (or none) or the new one, never a part. With `durable` the
/// temporary is fsync'ed before the rename and the directory after it (what a checkpoint needs).
/// A symbolic link is followed (its final target is replaced; the link stays). An existing device node or FIFO
/// (/dev/null, /dev/stdout, a named pipe) is written in place, not replaced, every write and the close checked
/// (/dev/full fails with "No space left on device"); a FIFO waits up to 30 s for a reader. A directory or a socket
/// is refused. IOError "<what>: ..." naming the file and the system's reason; the temporary is removed on failure.
void write_file(const std::string& path, const std::string& bytes, const std::string& what, bool durable = false);

/// Where a write to `path` lands: `path` itself, or where its chain of symbolic links ends (relative targets read
/// from the link's directory), which need not exist yet. IOError on a loop or an unreadable link.
std::string final_target(const std::string& path);

/// Whether `path` (its symbolic links followed) is a regular file or does not exist yet: a file that can be
/// rewritten as a run goes on. A device node or a FIFO gets one write, at the end (a reader of a pipe expects
/// one document).
bool rewritable(const std::string& path);

}  // namespace twobp
