// twobp/files.h: write_file writes whole or not at all (no temporary left, the old file intact on failure, errors
// naming the file), follows symbolic links, writes device nodes and FIFOs in place; make_directories is mkdir -p.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include <fstream>
#include <sstream>
#include <string>

#include "common/temp_files.h"
#include "twobp/error.h"
#include "twobp/files.h"

namespace twobp {
namespace {

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

class Files : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::make_temp_dir("files"); }
  void TearDown() override { testing::remove_tree(dir_); }
  // Calls `write` and expects an IOError whose message holds each of `parts`.
  template <typename F>
  void expect_io_error(F write, std::initializer_list<std::string> parts) {
    try {
      write();
      ADD_FAILURE() << "no IOError";
    } catch (const IOError& e) {
      for (const std::string& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  }
  std::string dir_;
};

TEST_F(Files, WritesTheBytesAndLeavesNoTemporary) {
  for (const bool durable : {false, true}) {
    const std::string path = dir_ + "/out.json";
    const std::string bytes = std::string("{\"a\": 1}\n") + std::string(1 << 20, 'x') + std::string(1, '\0');
    write_file(path, bytes, "test", durable);
    EXPECT_EQ(read(path), bytes);
    write_file(path, "short", "test", durable);  // replaces a longer file entirely
    EXPECT_EQ(read(path), "short");
    write_file(path, "", "test", durable);
    EXPECT_EQ(read(path), "");
    EXPECT_FALSE(testing::file_exists(path + ".tmp"));
  }
}

TEST_F(Files, AFailedWriteLeavesTheOldFileAndNamesTheFile) {
  const std::string path = dir_ + "/kept.txt";
  write_file(path, "old", "test");
  // The temporary cannot be created: a directory of its name is in the way.
  ASSERT_EQ(::mkdir((path + ".tmp").c_str(), 0755), 0);
  expect_io_error([&] { write_file(path, "new", "--json"); }, {"--json", path + ".tmp"});
  EXPECT_EQ(read(path), "old");
  // A directory where the file should go: refused before anything is written, the directory stays.
  const std::string taken = dir_ + "/taken";
  ASSERT_EQ(::mkdir(taken.c_str(), 0755), 0);
  expect_io_error([&] { write_file(taken, "new", "checkpoint"); }, {"checkpoint", taken, "is a directory"});
  EXPECT_TRUE(is_directory(taken));
  EXPECT_FALSE(testing::file_exists(taken + ".tmp"));
  // No such directory.
  expect_io_error([&] { write_file(dir_ + "/missing/out", "x", "--trace"); }, {"--trace", dir_ + "/missing/out.tmp"});
}

bool is_link(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
}

TEST_F(Files, ASymbolicLinkStaysAndItsTargetIsReplaced) {
  ASSERT_EQ(::mkdir((dir_ + "/real").c_str(), 0755), 0);
  const std::string target = dir_ + "/real/out.json";
  write_file(target, "old", "test");
  ASSERT_EQ(::symlink(target.c_str(), (dir_ + "/absolute").c_str()), 0);
  ASSERT_EQ(::symlink("real/out.json", (dir_ + "/relative").c_str()), 0);  // read from the link's directory
  ASSERT_EQ(::symlink("relative", (dir_ + "/chain").c_str()), 0);
  for (const char* link : {"absolute", "relative", "chain"}) {
    SCOPED_TRACE(link);
    write_file(dir_ + "/" + link, link, "--json", /*durable=*/true);
    EXPECT_TRUE(is_link(dir_ + "/" + link));
    EXPECT_EQ(read(target), link);
    EXPECT_FALSE(testing::file_exists(dir_ + "/" + link + ".tmp"));
    EXPECT_FALSE(testing::file_exists(target + ".tmp"));
  }
  // A dangling link: its target is created, the link kept.
  ASSERT_EQ(::symlink("real/new.json", (dir_ + "/dangling").c_str()), 0);
  write_file(dir_ + "/dangling", "new", "test");
  EXPECT_TRUE(is_link(dir_ + "/dangling"));
  EXPECT_EQ(read(dir_ + "/real/new.json"), "new");
  // A loop is an error, not a hang.
  ASSERT_EQ(::symlink("loop_b", (dir_ + "/loop_a").c_str()), 0);
  ASSERT_EQ(::symlink("loop_a", (dir_ + "/loop_b").c_str()), 0);
  expect_io_error([&] { write_file(dir_ + "/loop_a", "x", "--trace"); }, {"--trace", "loop_a", "symbolic links"});
}

TEST_F(Files, AFifoIsWrittenInPlace) {
  const std::string fifo = dir_ + "/pipe";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const std::string bytes = std::string(1 << 20, 'y') + "end";  // more than a pipe's buffer
  std::string received;
  std::thread reader([&] { received = read(fifo); });
  write_file(fifo, bytes, "--json", /*durable=*/true);
  reader.join();
  EXPECT_EQ(received, bytes);
  struct stat st;
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  EXPECT_FALSE(testing::file_exists(fifo + ".tmp"));
  EXPECT_FALSE(rewritable(fifo));
  EXPECT_FALSE(rewritable(dir_));
  EXPECT_TRUE(rewritable(dir_ + "/absent"));
  write_file(dir_ + "/regular", "x", "test");
  EXPECT_TRUE(rewritable(dir_ + "/regular"));
  ASSERT_EQ(::symlink("pipe", (dir_ + "/to_pipe").c_str()), 0);
  EXPECT_FALSE(rewritable(dir_ + "/to_pipe"));
}

// Private copies of /dev/null (1, 3) and /dev/full (1, 7): the system's own are never touched by a test.
TEST_F(Files, ADeviceNodeIsWrittenInPlaceAndAFullDeviceIsAnError) {
  const std::string null_node = dir_ + "/null", full_node = dir_ + "/full";
  if (::mknod(null_node.c_str(), S_IFCHR | 0666, makedev(1, 3)) != 0 ||
      ::mknod(full_node.c_str(), S_IFCHR | 0666, makedev(1, 7)) != 0) {
    GTEST_SKIP() << "mknod of a character device failed (" << std::strerror(errno)
                 << "): needs root with CAP_MKNOD";
  }
  for (const bool durable : {false, true}) {
    write_file(null_node, "discarded", "--json", durable);
    expect_io_error([&] { write_file(full_node, std::string(4096, 'z'), "--json", durable); },
                    {"--json", full_node, "No space left on device"});
  }
  for (const std::string& node : {null_node, full_node}) {
    struct stat st;
    ASSERT_EQ(::lstat(node.c_str(), &st), 0);
    EXPECT_TRUE(S_ISCHR(st.st_mode)) << node << " was replaced";
    EXPECT_FALSE(testing::file_exists(node + ".tmp"));
  }
}

TEST_F(Files, MakeDirectoriesCreatesEveryMissingParent) {
  const std::string deep = dir_ + "/a/b/c";
  make_directories(deep);
  EXPECT_TRUE(is_directory(deep));
  make_directories(deep + "/");  // existing, trailing slash: nothing to do
  make_directories(dir_ + "/a/b/d");
  EXPECT_TRUE(is_directory(dir_ + "/a/b/d"));
  write_file(dir_ + "/a/file", "x", "test");
  expect_io_error([&] { make_directories(dir_ + "/a/file/e"); }, {dir_ + "/a/file"});
}

}  // namespace
}  // namespace twobp
