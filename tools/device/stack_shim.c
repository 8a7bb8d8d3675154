// A diagnostic for device runs without gdb (tools/device/jpeg-check.sh, STACKS=1): preloaded
// into a program (LD_PRELOAD), it prints the receiving thread's stack to stderr on SIGUSR2, as
// "binary(+offset)" frames that addr2line resolves against the same binary. The script signals
// each thread with tgkill. Not async-signal-safe (backtrace may allocate once); for diagnosis
// of a process that is stuck anyway.
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

static void print_stack(int sig) {
  (void)sig;
  void* frames[64];
  const int n = backtrace(frames, 64);
  char head[64];
  const int len = snprintf(head, sizeof head, "== stack of thread %ld\n", (long)syscall(SYS_gettid));
  if (len > 0) write(2, head, (size_t)len);
  backtrace_symbols_fd(frames, n, 2);
}

__attribute__((constructor)) static void install(void) {
  void* warm[2];
  backtrace(warm, 2);  // loads libgcc_s now, not inside the handler
  signal(SIGUSR2, print_stack);
}
