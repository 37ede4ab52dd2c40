# tier_wall (label unit): no file of the core -- src/ and include/twobp/, divided by cmake/TwobpTiers.cmake --
# includes a header of the kit (or twobp/twobp.h, which includes the kit), so that twobp::core compiles and links
# without twobp::kit (docs/ARCHITECTURE.md). Private headers of src/ count by their folder, as sources do.
#   cmake -DPROJECT_DIR=<checkout> -P tests/install/check_wall.cmake
cmake_policy(SET CMP0057 NEW)  # if(IN_LIST) in twobp_tier
include(${PROJECT_DIR}/cmake/TwobpTiers.cmake)

set(violations "")
set(checked 0)
foreach(root src include/twobp)
  file(GLOB_RECURSE files RELATIVE ${PROJECT_DIR}/${root} ${PROJECT_DIR}/${root}/*.h ${PROJECT_DIR}/${root}/*.cpp)
  foreach(file IN LISTS files)
    twobp_tier(${file} tier)
    if(NOT tier STREQUAL "core")
      continue()
    endif()
    math(EXPR checked "${checked} + 1")
    file(STRINGS ${PROJECT_DIR}/${root}/${file} lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<]")
    foreach(line IN LISTS lines)
      if(NOT line MATCHES "include[ \t]*[\"<]([^\">]+)[\">]")
        continue()
      endif()
      set(header ${CMAKE_MATCH_1})
      if(header MATCHES "^twobp/(.+)$")
        set(header ${CMAKE_MATCH_1})  # a public header, relative to include/twobp/
      elseif(NOT EXISTS ${PROJECT_DIR}/src/${header})
        continue()  # LibTorch's, the standard library's, a generated one
      endif()
      twobp_tier(${header} included)
      if(NOT included STREQUAL "core")
        string(APPEND violations "\n  ${root}/${file} (core) includes ${header} (${included}): ${line}")
      endif()
    endforeach()
  endforeach()
endforeach()

if(violations)
  message(FATAL_ERROR "the core includes the kit (move the code, or the file's tier in cmake/TwobpTiers.cmake; "
                      "docs/ARCHITECTURE.md):${violations}")
endif()
message(STATUS "tier_wall: ${checked} core files include no kit header")
