# Warnings for our own code (torch headers are included as SYSTEM and stay quiet), and an
# optional sanitizer build: -DRESILIENT_COMM_SANITIZE=address|thread.
add_library(rc_warnings INTERFACE)
target_compile_options(rc_warnings INTERFACE -Wall -Wextra -Wno-unused-parameter)

set(RESILIENT_COMM_SANITIZE "" CACHE STRING "address or thread")
if(RESILIENT_COMM_SANITIZE)
  target_compile_options(rc_warnings INTERFACE -fsanitize=${RESILIENT_COMM_SANITIZE} -fno-omit-frame-pointer)
  target_link_options(rc_warnings INTERFACE -fsanitize=${RESILIENT_COMM_SANITIZE})
endif()
