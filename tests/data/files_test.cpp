// twobp/files.h: write_file writes whole or not at all (no temporary left, the old file intact on failure, errors
// naming the file), make_directories is mkdir -p.
#include <gtest/gtest.h>
#include <sys/stat.h>

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
  // A directory where the file should go: the rename fails, the temporary is removed, the directory stays.
  const std::string taken = dir_ + "/taken";
  ASSERT_EQ(::mkdir(taken.c_str(), 0755), 0);
  expect_io_error([&] { write_file(taken, "new", "checkpoint"); }, {"checkpoint", "renaming", taken});
  EXPECT_TRUE(is_directory(taken));
  EXPECT_FALSE(testing::file_exists(taken + ".tmp"));
  // No such directory.
  expect_io_error([&] { write_file(dir_ + "/missing/out", "x", "--trace"); }, {"--trace", dir_ + "/missing/out.tmp"});
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
