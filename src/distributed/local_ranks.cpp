#include "dalle/distributed/local_ranks.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <filesystem>
#include <map>
#include <thread>

#include "dalle/error.h"
#include "dalle/log.h"

namespace dalle::distributed {

namespace {

volatile std::sig_atomic_t signals_received = 0;
volatile std::sig_atomic_t last_signal = 0;

// Counts the stop requests: the first signal, then each ^C. A repeated SIGTERM is the same
// request delivered again (`timeout` sends it to the launcher and again to its group).
void count_signal(int signal) {
  if (signals_received > 0 && signal != SIGINT) return;
  last_signal = signal;
  signals_received = signals_received + 1;
}

// A TCP socket listening on 127.0.0.1 at a port the kernel chose.
int listen_on_loopback(int& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);  // inherited by rank 0 across exec
  if (fd < 0) throw Error(std::string("--nproc-per-node: cannot open a socket: ") + std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof address;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 || ::listen(fd, 128) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    const std::string reason = std::strerror(errno);
    ::close(fd);
    throw Error("--nproc-per-node: cannot listen on 127.0.0.1: " + reason);
  }
  port = ntohs(address.sin_port);
  return fd;
}

// The program's own file: exec'ing it by path names the ranks as the tool, not "exe".
std::string own_program() {
  std::error_code error;
  const auto path = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) throw Error("--nproc-per-node: cannot find this program's file: " + error.message());
  return path.string();
}

[[noreturn]] void exec_rank(const std::string& program, const LocalRanksOptions& options, int64_t rank, int port,
                            int listen_fd) {
  ::setpgid(0, 0);  // the launcher alone hears the terminal's ^C, and passes it on once
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // a launcher that dies stops its ranks
  const auto set = [](const char* name, const std::string& value) { ::setenv(name, value.c_str(), 1); };
  set("RANK", std::to_string(rank));
  set("LOCAL_RANK", std::to_string(rank));
  set("WORLD_SIZE", std::to_string(options.ranks));
  set("LOCAL_WORLD_SIZE", std::to_string(options.ranks));
  set("GROUP_RANK", "0");
  set("MASTER_ADDR", "127.0.0.1");
  set("MASTER_PORT", std::to_string(port));
  set("DALLE_LAUNCHER", "dalle --nproc-per-node");
  if (std::getenv("OMP_NUM_THREADS") == nullptr) set("OMP_NUM_THREADS", std::to_string(options.threads_per_rank));
  if (rank == 0) {
    set("DALLE_STORE_FD", std::to_string(listen_fd));
  } else {
    ::close(listen_fd);
  }
  std::vector<char*> argv;
  for (const auto& argument : options.arguments) argv.push_back(const_cast<char*>(argument.c_str()));
  argv.push_back(nullptr);
  ::execv(program.c_str(), argv.data());
  std::fprintf(stderr, "rank %lld: cannot run %s: %s\n", static_cast<long long>(rank), program.c_str(),
               std::strerror(errno));
  std::_Exit(127);
}

std::string describe(int status) {
  if (WIFSIGNALED(status)) {
    return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  }
  return "exited with status " + std::to_string(WEXITSTATUS(status));
}

// A rank that stopped on request (SIGINT, SIGTERM: 130, 143) ended as asked; others failed.
bool failed(int status) {
  if (WIFSIGNALED(status)) return true;
  const int code = WEXITSTATUS(status);
  return code != 0 && code != 128 + SIGINT && code != 128 + SIGTERM;
}

class SignalsCounted {
 public:
  SignalsCounted() {
    signals_received = 0;
    struct sigaction action {};
    action.sa_handler = count_signal;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGINT, &action, &previous_int_);
    ::sigaction(SIGTERM, &action, &previous_term_);
  }
  ~SignalsCounted() {
    ::sigaction(SIGINT, &previous_int_, nullptr);
    ::sigaction(SIGTERM, &previous_term_, nullptr);
  }

 private:
  struct sigaction previous_int_ {}, previous_term_ {};
};

}  // namespace

LocalRanksOutcome run_local_ranks(const LocalRanksOptions& options) {
  if (options.ranks < 1) throw Error("--nproc-per-node must be at least 1");
  const auto program = own_program();
  int port = 0;
  const int listen_fd = listen_on_loopback(port);
  log::info("starting ", options.ranks, " ranks on 127.0.0.1:", port, "; rank 0 reports progress");
  SignalsCounted signals;
  std::map<pid_t, int64_t> running;  // pid -> rank
  for (int64_t rank = 0; rank < options.ranks; ++rank) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      for (const auto& [other, _] : running) ::kill(other, SIGKILL);
      throw Error(std::string("--nproc-per-node: cannot fork: ") + std::strerror(errno));
    }
    if (pid == 0) exec_rank(program, options, rank, port, listen_fd);
    running[pid] = rank;
  }
  ::close(listen_fd);

  LocalRanksOutcome outcome;
  int stop_status = 0;
  std::sig_atomic_t signals_passed_on = 0;
  const auto signal_all = [&running](int signal) {
    for (const auto& [pid, _] : running) ::kill(pid, signal);
  };
  while (!running.empty()) {
    if (signals_received > signals_passed_on) {
      // The first ^C or SIGTERM asks the ranks to checkpoint and stop; a ^C after it ends them.
      signals_passed_on = signals_received;
      signal_all(signals_passed_on == 1 ? static_cast<int>(last_signal) : SIGKILL);
      stop_status = 128 + last_signal;
    }
    // Polled, not blocking: a signal that lands between the check above and a blocking wait
    // would wait for a rank to end before it was passed on.
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid == 0 || (pid < 0 && errno == EINTR)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    if (pid < 0) throw Error(std::string("--nproc-per-node: waiting for the ranks: ") + std::strerror(errno));
    const auto found = running.find(pid);
    if (found == running.end()) continue;
    const int64_t rank = found->second;
    running.erase(found);
    if (failed(status) && outcome.failed_rank < 0) {
      outcome.failed_rank = rank;
      outcome.failure = describe(status);
      outcome.exit_status = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
      // The others would wait on the lost rank until their timeout; their checkpoints are
      // whole files or absent, so ending them loses nothing.
      signal_all(SIGKILL);
    } else if (outcome.failed_rank < 0 && WIFEXITED(status) && WEXITSTATUS(status) != 0) {
      stop_status = WEXITSTATUS(status);
    }
  }
  if (outcome.failed_rank < 0) outcome.exit_status = stop_status;
  return outcome;
}

}  // namespace dalle::distributed
