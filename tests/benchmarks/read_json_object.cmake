# include()d by the check_*_json.cmake scripts: reads ${JSON} into _doc, failing unless it is a JSON object.
if(NOT EXISTS "${JSON}")
  message(FATAL_ERROR "${JSON}: no such file")
endif()
file(READ "${JSON}" _doc)
string(JSON _type ERROR_VARIABLE _err TYPE "${_doc}")
if(_err OR NOT _type STREQUAL "OBJECT")
  message(FATAL_ERROR "${JSON}: not a JSON object (${_err})")
endif()
