# Warnings for our own code (torch headers are included as SYSTEM and stay quiet), and an
# optional sanitizer build: -DRESILIENT_COMM_SANITIZE=address,undefined | thread (any list
# -fsanitize= takes). scripts/sanitize.sh builds and runs the C++ tests that way.
add_library(rc_warnings INTERFACE)
target_compile_options(rc_warnings INTERFACE -Wall -Wextra -Wno-unused-parameter)

set(RESILIENT_COMM_SANITIZE "" CACHE STRING "sanitizers, as -fsanitize= takes them: address,undefined or thread")
if(RESILIENT_COMM_SANITIZE)
  # A finding fails the run (UBSan would only print and go on); frames stay readable.
  target_compile_options(rc_warnings INTERFACE -fsanitize=${RESILIENT_COMM_SANITIZE} -fno-sanitize-recover=all
                                               -fno-omit-frame-pointer -g)
  target_link_options(rc_warnings INTERFACE -fsanitize=${RESILIENT_COMM_SANITIZE})
endif()
