# twobp_add_program_dirs(): adds every subdirectory of the current source directory that has a CMakeLists.txt,
# with binary directory _<name>, so that the program it builds can live at build/<dir>/<name> (the path the README
# and the issues use) without clashing with its own binary directory.
function(twobp_add_program_dirs)
  file(GLOB dirs LIST_DIRECTORIES true CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*)
  foreach(dir IN LISTS dirs)
    if(IS_DIRECTORY ${dir} AND EXISTS ${dir}/CMakeLists.txt)
      get_filename_component(name ${dir} NAME)
      add_subdirectory(${dir} ${CMAKE_CURRENT_BINARY_DIR}/_${name})
    endif()
  endforeach()
endfunction()
