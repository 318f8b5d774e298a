/*
 * corral-agent: the process inside a container sandbox that runs commands.
 *
 * It is the container's init (PID 1) or, after an edge restart, a second
 * process started with `crun exec`. It talks to the edge over one inherited
 * socket (fd 3 by default), never over anything in the sandbox's filesystem
 * or network, and makes itself non-dumpable so sandbox processes cannot open
 * its fds through /proc or ptrace it.
 *
 * Guest mode (inside a microVM/VM, started by the project's initramfs):
 *   --dev PATH   the channel is a virtio-serial port; when the host end goes
 *                away (POLLHUP) the agent waits for it and greets it again.
 *   --root DIR   commands chroot into the sandbox's root (the overlay).
 *   --tool PATH  a static binary (busybox); EXEC with flag 2 runs it by fd,
 *                so file operations need nothing from the sandbox's image.
 *                Flag 4 runs it without the chroot (e.g. to pack the
 *                writable layer, which only the guest's own root shows).
 *
 * gVisor mode (runsc sandboxes, as their init):
 *   --connect PATH  the channel is a Unix socket the edge listens on; when the
 *                edge closes it the agent connects again every 50 ms.
 *   --tool PATH  as above (the sentry serves the root: the host cannot open it).
 *
 * Any mode:
 *   --new-privs allowed  leave no_new_privs off, so setuid programs (sudo) work
 *                for sandboxes that allow them; otherwise every command runs
 *                with it set. The seccomp filter and capability bounding set
 *                apply either way.
 *   --shm DIR    make DIR (mode 1777) before anything runs, unless it is
 *                there: a crun sandbox's /dev/shm, a directory of its /dev.
 *
 * Wire format (little endian), both directions:
 *   u32 length (of what follows) | u8 type | u32 job id | payload
 * EXEC flags: 1 stdin, 2 tool, 4 outside the chroot, 8 a terminal: the command
 *   gets a pseudo-terminal of the sandbox's devpts as its controlling terminal
 *   and stdin/stdout/stderr (output comes as STDOUT); u16 rows, u16 cols follow
 *   the strings; 16 a walk after the command: a FIND request's payload follows
 *   (after the terminal size, if any), walked once the command has exited; its
 *   names come as FOUND frames before the EXIT, which has flag 16 (walked) and
 *   8 (the walk was cut short). An agent that predates it sends no flag 16.
 *   64: IPC counts at the exit: if the agent is the sandbox's init (pid 1) and
 *   then has no child at all (so no other process is in the sandbox) and runs
 *   no other command, the EXIT has flag 32 and the three IPC_COUNTS u32s after
 *   its flags. Nothing can make an IPC object until the next EXEC, so the edge
 *   takes them for an IPC_QUERY's answer until it sends one. An agent that
 *   predates it sends no flag 32; a second agent (`crun exec` after an edge
 *   restart) is not pid 1 and sends none either.
 * Edge -> agent: EXEC, STDIN (empty payload closes stdin; for a terminal it
 *   is ignored: the user types ^D), SIGNAL, PING, RESIZE (u16 rows, u16 cols),
 *   KILL_ALL (SIGKILL every other process in the sandbox; answered with PONG),
 *   IPC_QUERY (how many SysV IPC objects the sandbox's IPC namespace holds),
 *   FIND (u32 byte cap, root, NUL, then NUL-terminated paths under it: every
 *   non-directory at or below each path that exists, symlinks not followed,
 *   named relative to root and NUL-terminated, as STDOUT frames, then EXIT 0
 *   with flag 2 if the cap or FIND_BUDGET_MS cut it short). An agent that
 *   predates a request type ignores it. IDENTIFY (version 3; a restored
 *   guest's new identity: hostname, NUL, then host entropy credited to the
 *   kernel's RNG; answered with PONG, or ERROR saying what failed).
 * Agent -> edge: HELLO, STARTED, STDOUT, STDERR, EXIT, ERROR, PONG,
 *   IPC_COUNTS (u32 shared memory segments, message queues, semaphore sets),
 *   FOUND (names of an EXEC's walk, as FIND's STDOUT).
 * Keep in sync with corral/backends/common/agent_protocol.py.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/random.h>
#include <sys/ipc.h>
#include <sys/msg.h>
#include <sys/prctl.h>
#include <sys/sem.h>
#include <sys/shm.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum {
    T_EXEC = 1, T_STDIN = 2, T_SIGNAL = 3, T_PING = 4, T_KILL_ALL = 5, T_RESIZE = 6,
    T_STARTED = 10, T_STDOUT = 11, T_STDERR = 12, T_EXIT = 13, T_ERROR = 14,
    T_PONG = 15, T_HELLO = 20,
    T_IPC_QUERY = 31, T_IPC_COUNTS = 32, T_FIND = 33, T_FOUND = 34, T_IDENTIFY = 35,
};
enum { F_TIMED_OUT = 1, F_OUT_TRUNC = 2, F_ERR_TRUNC = 4, F_WALK_CUT = 8, F_WALKED = 16, F_IPC_ALONE = 32 };
enum { X_STDIN = 1, X_TOOL = 2, X_NO_CHROOT = 4, X_TERMINAL = 8, X_WALK_AFTER = 16, X_QUIET_START = 32,
       X_IPC_AFTER = 64 };
#define AGENT_VERSION 3 /* 2: terminals (EXEC flag 8, RESIZE); 3: IDENTIFY */
#define MAX_FRAME (16u << 20)
#define MAX_JOBS 1024
#define CHUNK 65536

struct job {
    uint32_t id;
    pid_t pid;
    int out_fd, err_fd, in_fd;
    uint64_t cap, out_sent, err_sent;
    int flags;
    int exited, status;
    int64_t deadline_ms;          /* 0 = no timeout */
    char *in_buf;
    size_t in_len, in_off;
    int in_close;                 /* close stdin once the buffer is written */
    int terminal;                 /* out_fd and in_fd are dups of a terminal's master side */
    char *walk_req;               /* EXEC flag 16: a FIND payload to walk once the command has exited */
    size_t walk_req_len;
    int ipc_after;                /* EXEC flag 64: IPC counts on the exit, if the agent is alone by then */
};

static int ctl = -1;
static const char *ctl_dev;       /* guest mode: the virtio-serial port to the host */
static const char *ctl_path;      /* gVisor: the edge's Unix socket; reconnected after the edge lets go */
static int tool_fd = -1;          /* guest mode: busybox, run by fd for EXEC flag 2 */
static const char *sandbox_root;  /* guest mode: commands chroot here (unless flag 4) */
/* A command's child runs in the agent's memory on this stack until its exec (clone with CLONE_VM | CLONE_VFORK, as
 * posix_spawn does): no copy of the agent's page tables, no copy-on-write faults, no TLB shootdown: the edge's time for an exec
 * of `true` 0.95-1.06 ms against 1.08-1.22 here (docs/spec.md, Load). The agent waits meanwhile, so STARTED goes out once the command is
 * running, not about to; a chdir or exec that waits on a layer still being fetched holds the agent that long. So
 * the child writes the agent's memory only where the agent expects it (its own stack, the command's envp array,
 * `environ`, which start_job restores) and uses the heap only in resolve_user's fopen/fclose, while the agent is
 * stopped. One child at a time: the agent is stopped until the exec. */
static char child_stack[64 * 1024] __attribute__((aligned(64)));
static struct job *jobs[MAX_JOBS];
static int njobs;
static char *rbuf;
static size_t rlen, rcap;

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int dev_fd = -1;           /* guest mode: the port stays open; ctl is dev_fd while the host is there */

static void disconnect(void) {
    if (ctl >= 0 && ctl != dev_fd) close(ctl);
    ctl = -1;
}

static int write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Header and payload in one writev: the edge wakes once for a frame, not once for its header and again for the rest. */
static void send_frame(uint8_t type, uint32_t id, const void *payload, size_t len) {
    if (ctl < 0) return;
    char hdr[9];
    uint32_t total = (uint32_t)(5 + len);
    memcpy(hdr, &total, 4);
    hdr[4] = (char)type;
    memcpy(hdr + 5, &id, 4);
    struct iovec iov[2] = {{.iov_base = hdr, .iov_len = 9}, {.iov_base = (void *)payload, .iov_len = len}};
    ssize_t n;
    do n = writev(ctl, iov, len ? 2 : 1);
    while (n < 0 && errno == EINTR);
    if (n < 0) {
        disconnect();
        return;
    }
    size_t sent = (size_t)n;  /* a partial write (a full socket buffer): the rest as write_all writes it */
    if (sent < 9 && write_all(ctl, hdr + sent, 9 - sent) < 0) {
        disconnect();
        return;
    }
    size_t payload_sent = sent > 9 ? sent - 9 : 0;
    if (payload_sent < len && write_all(ctl, (const char *)payload + payload_sent, len - payload_sent) < 0)
        disconnect();
}

static void send_error(uint32_t id, const char *fmt, const char *arg) {
    char msg[512];
    snprintf(msg, sizeof msg, fmt, arg, strerror(errno));
    send_frame(T_ERROR, id, msg, strlen(msg));
}

static struct job *find_job(uint32_t id) {
    for (int i = 0; i < njobs; i++)
        if (jobs[i]->id == id) return jobs[i];
    return NULL;
}

/* Look up a user in the sandbox's /etc/passwd: names, "uid" or "uid:gid". */
static int resolve_user(const char *spec, uid_t *uid, gid_t *gid, char *home, size_t home_len) {
    char *end;
    *uid = 0;
    *gid = 0;
    snprintf(home, home_len, "/");
    if (spec[0] == '\0') spec = "root";
    unsigned long n = strtoul(spec, &end, 10);
    int numeric = end != spec && (*end == '\0' || *end == ':');
    FILE *f = fopen("/etc/passwd", "re");
    char line[1024];
    int found = 0;
    while (f && fgets(line, sizeof line, f)) {
        char *fields[7] = {0};
        char *save = NULL, *tok = line;
        int k = 0;
        for (char *p = strtok_r(tok, ":\n", &save); p && k < 7; p = strtok_r(NULL, ":\n", &save)) fields[k++] = p;
        if (k < 6) continue;
        if ((numeric && strtoul(fields[2], NULL, 10) == n) || (!numeric && strcmp(fields[0], spec) == 0)) {
            *uid = (uid_t)strtoul(fields[2], NULL, 10);
            *gid = (gid_t)strtoul(fields[3], NULL, 10);
            snprintf(home, home_len, "%s", fields[5]);
            found = 1;
            break;
        }
    }
    if (f) fclose(f);
    if (numeric) {
        *uid = (uid_t)n;
        if (!found) *gid = (gid_t)n;
        if (*end == ':') *gid = (gid_t)strtoul(end + 1, NULL, 10);
        return 0;
    }
    return found ? 0 : -1;
}

static int has_env(char **envp, const char *name) {
    size_t len = strlen(name);
    for (char **e = envp; *e; e++)
        if (strncmp(*e, name, len) == 0 && (*e)[len] == '=') return 1;
    return 0;
}

__attribute__((noreturn)) static void child_fail(const char *what, const char *arg, int code) {
    char message[1024];  /* formatted on the child's stack: no stdio buffer in the agent's heap */
    int len = snprintf(message, sizeof message, "corral: %s '%s': %s\n", what, arg, strerror(errno));
    if (len > 0) (void)!write(2, message, (size_t)len < sizeof message ? (size_t)len : sizeof message - 1);
    _exit(code);
}

/* Close every descriptor from 3 up but a and b (-1: none). */
static void close_all_but(int a, int b) {
    int keep[2] = {a < b ? a : b, a < b ? b : a};
    unsigned next = 3;
    int ok = 1;
    for (int i = 0; i < 2 && ok; i++) {
        if (keep[i] < (int)next) continue;
        if ((unsigned)keep[i] > next && close_range(next, (unsigned)keep[i] - 1, 0) < 0) ok = 0;
        next = (unsigned)keep[i] + 1;
    }
    if (!ok || close_range(next, ~0u, 0) < 0)
        for (int fd = 3; fd < 1024; fd++)
            if (fd != a && fd != b) close(fd);
}

struct child {
    int in_fd, out_w, err_w;
    const char *user, *cwd;
    char **argv, **envp;
    int nenv, flags;
};

/* In the child (on child_stack, in the agent's memory): become the command. Never returns. */
static int run_child(void *arg) {
    const struct child *c = arg;
    int in_fd = c->in_fd, out_w = c->out_w, err_w = c->err_w, nenv = c->nenv, flags = c->flags;
    const char *user = c->user, *cwd = c->cwd;
    char **argv = c->argv, **envp = c->envp;
    int use_tool = (flags & 2) != 0;
    signal(SIGPIPE, SIG_DFL);  /* the defaults back before the agent's blocked signals are let through */
    signal(SIGTERM, SIG_DFL);
    signal(SIGINT, SIG_DFL);
    signal(SIGHUP, SIG_DFL);
    sigset_t all;
    sigemptyset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);
    setsid();
    dup2(in_fd, 0);
    dup2(out_w, 1);
    dup2(err_w, 2);
    if ((flags & X_TERMINAL) && ioctl(0, TIOCSCTTY, 0) < 0) child_fail("cannot take the terminal", "", 126);
    close_all_but(use_tool ? tool_fd : -1, -1);  /* the tool stays open for fexecve (it is close-on-exec) */
    int adj = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (adj >= 0) {
        (void)!write(adj, "0", 1);
        close(adj);
    }
    if (sandbox_root && !(flags & 4) && (chroot(sandbox_root) < 0 || chdir("/") < 0))
        child_fail("cannot enter the sandbox root", sandbox_root, 126);
    uid_t uid;
    gid_t gid;
    char home[512];
    if (resolve_user(user, &uid, &gid, home, sizeof home) < 0) {
        errno = ENOENT;
        child_fail("unknown user", user, 126);
    }
    /* Fill HOME/USER the way a login would, unless the caller set them. */
    char home_env[600], user_env[300];
    int k = nenv;
    if (!has_env(envp, "HOME")) {
        snprintf(home_env, sizeof home_env, "HOME=%s", home);
        envp[k++] = home_env;
    }
    if (!has_env(envp, "USER") && !(user[0] >= '0' && user[0] <= '9')) {
        snprintf(user_env, sizeof user_env, "USER=%s", user[0] ? user : "root");
        envp[k++] = user_env;
    }
    envp[k] = NULL;
    if (flags & X_TERMINAL) {  /* the user owns their terminal, as after a login (write access for the tty group) */
        (void)!fchown(0, uid, (gid_t)-1);
        (void)!fchmod(0, 0620);
    }
    if (setgroups(1, &gid) < 0 && uid != getuid()) child_fail("cannot set groups for", user, 126);
    if (setgid(gid) < 0) child_fail("cannot switch group for", user, 126);
    if (setuid(uid) < 0) child_fail("cannot switch to user", user, 126);
    if (cwd[0] && chdir(cwd) < 0) child_fail("cannot change directory to", cwd, 126);
    environ = envp;  /* the agent's own: start_job restores it once the child has exec'd */
    if (use_tool) {
        if (tool_fd < 0) {
            errno = ENOENT;
            child_fail("no tool binary in this sandbox", argv[0], 127);
        }
        fexecve(tool_fd, argv, envp);
        child_fail("cannot run tool", argv[0], 126);
    }
    execvp(argv[0], argv);
    child_fail("cannot run", argv[0], errno == ENOENT ? 127 : 126);
}

/* A new pseudo-terminal of the devpts the commands see (the sandbox's root's, in guest mode): master and slave,
 * both close-on-exec; the slave is not this agent's controlling terminal. -1 on failure (errno set). */
static int open_terminal(uint16_t rows, uint16_t cols, int *slave) {
    char path[4096];
    snprintf(path, sizeof path, "%s/dev/pts/ptmx", sandbox_root ? sandbox_root : "");
    int master = open(path, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (master < 0) master = open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (master < 0) return -1;
    int unlock = 0;
    struct winsize ws = {.ws_row = rows, .ws_col = cols};
    if (ioctl(master, TIOCSPTLCK, &unlock) < 0 || ioctl(master, TIOCSWINSZ, &ws) < 0) goto fail;
    *slave = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (*slave < 0) {  /* kernels or sandboxes (gVisor) without TIOCGPTPEER: open it by its number */
        unsigned int n;
        if (ioctl(master, TIOCGPTN, &n) < 0) goto fail;
        snprintf(path, sizeof path, "%s/dev/pts/%u", sandbox_root ? sandbox_root : "", n);
        *slave = open(path, O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (*slave < 0) goto fail;
    }
    return master;
fail:;
    int saved = errno;
    close(master);
    errno = saved;
    return -1;
}

static void start_job(uint32_t id, const char *p, size_t len) {
    if (find_job(id)) {
        send_error(id, "duplicate job id%s%s", "");
        return;
    }
    if (njobs >= MAX_JOBS) {
        errno = EAGAIN;
        send_error(id, "too many concurrent commands in this sandbox%s: %s", "");
        return;
    }
    if (len < 24) {
        errno = EINVAL;
        send_error(id, "malformed exec request%s: %s", "");
        return;
    }
    uint32_t flags, timeout_ms, argc, envc;
    uint64_t cap;
    memcpy(&flags, p, 4);
    memcpy(&timeout_ms, p + 4, 4);
    memcpy(&cap, p + 8, 8);
    memcpy(&argc, p + 16, 4);
    memcpy(&envc, p + 20, 4);
    /* Strings: user, cwd, argv..., env... each NUL-terminated. */
    size_t nstr = 2 + (size_t)argc + envc;
    if (argc == 0 || nstr > 100000) {
        errno = EINVAL;
        send_error(id, "malformed exec request%s: %s", "");
        return;
    }
    char **strs = calloc(nstr, sizeof(char *));
    char **envp = calloc(envc + 3, sizeof(char *));
    char **argv = calloc(argc + 1, sizeof(char *));
    const char *q = p + 24, *end = p + len;
    for (size_t i = 0; i < nstr; i++) {
        const char *z = memchr(q, 0, (size_t)(end - q));
        if (!z) {
            free(strs); free(envp); free(argv);
            errno = EINVAL;
            send_error(id, "malformed exec request%s: %s", "");
            return;
        }
        strs[i] = (char *)q;
        q = z + 1;
    }
    for (uint32_t i = 0; i < argc; i++) argv[i] = strs[2 + i];
    for (uint32_t i = 0; i < envc; i++) envp[i] = strs[2 + argc + i];
    /* After the strings: the terminal's size (flag 8), then the walk's request (flag 16). */
    const char *walk_at = q + ((flags & X_TERMINAL) ? 4 : 0);
    size_t walk_len = (flags & X_WALK_AFTER) && walk_at < end ? (size_t)(end - walk_at) : 0;

    int out[2], err[2], in[2];
    int has_stdin = flags & X_STDIN, term_fd = -1;
    if (flags & X_TERMINAL) {
        uint16_t size[2] = {24, 80};
        if ((size_t)(end - q) >= sizeof size) memcpy(size, q, sizeof size);
        int slave = -1;
        term_fd = open_terminal(size[0], size[1], &slave);
        if (term_fd < 0) {
            send_error(id, "cannot open a terminal%s: %s", "");
            free(strs); free(envp); free(argv);
            return;
        }
        /* The command's three fds are the slave; this side reads and writes the master through dups. */
        out[0] = term_fd;
        in[1] = fcntl(term_fd, F_DUPFD_CLOEXEC, 0);
        out[1] = slave;
        err[1] = fcntl(slave, F_DUPFD_CLOEXEC, 0);
        in[0] = fcntl(slave, F_DUPFD_CLOEXEC, 0);
        err[0] = -1;
        if (in[1] < 0 || err[1] < 0 || in[0] < 0) {
            send_error(id, "cannot open a terminal%s: %s", "");
            int fds[] = {out[0], in[1], out[1], err[1], in[0]};
            for (size_t i = 0; i < sizeof fds / sizeof fds[0]; i++)
                if (fds[i] >= 0) close(fds[i]);
            free(strs); free(envp); free(argv);
            return;
        }
    } else if (pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0 || pipe2(in, O_CLOEXEC) < 0) {
        send_error(id, "cannot create pipes%s: %s", "");
        free(strs); free(envp); free(argv);
        return;
    }
    if (!has_stdin && term_fd < 0) {
        close(in[1]);
        in[1] = -1;
        close(in[0]);
        in[0] = open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    struct child child = {in[0], out[1], err[1], strs[0], strs[1], argv, envp, (int)envc, (int)flags};
    char **agent_environ = environ;
    /* Returns once the child has exec'd (or exited): see child_stack. */
    pid_t pid = clone(run_child, child_stack + sizeof child_stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &child);
    int fork_errno = errno;
    environ = agent_environ;
    close(out[1]);
    close(err[1]);
    if (in[0] >= 0) close(in[0]);
    free(strs); free(envp); free(argv);
    if (pid < 0) {
        close(out[0]);
        if (err[0] >= 0) close(err[0]);
        if (in[1] >= 0) close(in[1]);
        errno = fork_errno;
        send_error(id, "cannot start command (process limit reached?)%s: %s", "");
        return;
    }
    struct job *j = calloc(1, sizeof *j);
    if (walk_len && (j->walk_req = malloc(walk_len))) {  /* no memory for it: no flag 16, the edge asks FIND */
        memcpy(j->walk_req, walk_at, walk_len);
        j->walk_req_len = walk_len;
    }
    j->id = id;
    j->pid = pid;
    j->ipc_after = (flags & X_IPC_AFTER) != 0;
    j->out_fd = out[0];
    j->err_fd = err[0];
    j->in_fd = in[1];
    j->terminal = term_fd >= 0;
    j->cap = cap;
    j->deadline_ms = timeout_ms ? now_ms() + timeout_ms : 0;
    fcntl(j->out_fd, F_SETFL, O_NONBLOCK);
    if (j->err_fd >= 0) fcntl(j->err_fd, F_SETFL, O_NONBLOCK);
    if (j->in_fd >= 0) fcntl(j->in_fd, F_SETFL, O_NONBLOCK);
    jobs[njobs++] = j;
    uint32_t upid = (uint32_t)pid;
    if (!(flags & X_QUIET_START)) send_frame(T_STARTED, id, &upid, 4);  /* a waited exec: the exit is all it reads */
}

static void close_stdin(struct job *j) {
    if (j->in_fd >= 0) close(j->in_fd);
    j->in_fd = -1;
    free(j->in_buf);
    j->in_buf = NULL;
    j->in_len = j->in_off = 0;
}

static void flush_stdin(struct job *j) {
    while (j->in_fd >= 0 && j->in_off < j->in_len) {
        ssize_t n = write(j->in_fd, j->in_buf + j->in_off, j->in_len - j->in_off);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) return;
            close_stdin(j);  /* EPIPE: the command stopped reading */
            return;
        }
        j->in_off += (size_t)n;
    }
    if (j->in_fd >= 0 && j->in_off == j->in_len) {
        free(j->in_buf);
        j->in_buf = NULL;
        j->in_len = j->in_off = 0;
        if (j->in_close) close_stdin(j);
    }
}

static void add_stdin(struct job *j, const char *p, size_t len) {
    if (j->in_fd < 0) return;
    if (len == 0) {
        if (j->terminal) return;  /* a terminal's input stays open while the command runs */
        j->in_close = 1;
    } else {
        j->in_buf = realloc(j->in_buf, j->in_len + len);
        memcpy(j->in_buf + j->in_len, p, len);
        j->in_len += len;
    }
    flush_stdin(j);
}

/* Read what a job's pipe holds; forward up to the cap, drop the rest. */
static void drain(struct job *j, int *fdp, uint64_t *sent, int trunc_flag, uint8_t type) {
    char buf[CHUNK];
    for (;;) {
        ssize_t n = read(*fdp, buf, sizeof buf);
        if (n > 0) {
            uint64_t room = *sent < j->cap ? j->cap - *sent : 0;
            size_t fwd = (uint64_t)n < room ? (size_t)n : (size_t)room;
            if (fwd) send_frame(type, j->id, buf, fwd);
            if (fwd < (size_t)n) j->flags |= trunc_flag;
            *sent += fwd;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) return;
        close(*fdp);  /* EOF or error */
        *fdp = -1;
        return;
    }
}

static void reap(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int i = 0; i < njobs; i++) {
            if (jobs[i]->pid == pid && !jobs[i]->exited) {
                jobs[i]->exited = 1;
                jobs[i]->status = status;
                break;
            }
        }
    }
}

/* Only a process inside the sandbox's IPC namespace sees its SysV objects (/proc/sysvipc read from the host
 * shows the host's): the edge asks here whether a call left any behind. UINT32_MAX = could not tell. */
static void count_ipc(uint32_t counts[3]) {
    struct shm_info shm;
    struct msginfo msg;
    struct seminfo sem;
    counts[0] = shmctl(0, SHM_INFO, (struct shmid_ds *)(void *)&shm) >= 0 ? (uint32_t)shm.used_ids : UINT32_MAX;
    counts[1] = msgctl(0, MSG_INFO, (struct msqid_ds *)(void *)&msg) >= 0 ? (uint32_t)msg.msgpool : UINT32_MAX;
    counts[2] = semctl(0, 0, SEM_INFO, &sem) >= 0 ? (uint32_t)sem.semusz : UINT32_MAX;
}

static void send_ipc_counts(uint32_t id) {
    uint32_t counts[3];
    count_ipc(counts);
    send_frame(T_IPC_COUNTS, id, counts, sizeof counts);
}

/* No child at all, live or dead (clone children too): as the sandbox's init, every other process in it would be
 * one or descend from one, so none is left that could make an IPC object. */
static int alone(void) {
    siginfo_t info;
    return getpid() == 1 && njobs == 1
        && waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT | __WALL) < 0 && errno == ECHILD;
}

/* FIND: what the edge's audit looks for after each command in a guest (protected paths in the writable layer),
 * walked here instead of by a busybox `sh` and `find` per command: two process starts a command, which a TCG
 * guest pays ~6 ms for, and translates afresh in every restored guest. One walk at a time (nftw has no user
 * pointer: the state is here). */
#define FIND_BUDGET_MS 5000 /* a tree too big to walk in this long is reported cut short, not waited for */
static struct {
    char *buf;
    size_t len, cap, skip;  /* skip: the root's length and its slash, left off each name */
    int64_t deadline;
    unsigned visited;
    int cut;
} walk;

static int find_visit(const char *path, const struct stat *st, int type, struct FTW *ftw) {
    (void)st;
    (void)ftw;
    if ((++walk.visited & 255) == 0 && now_ms() > walk.deadline) {
        walk.cut = 1;
        return 1;
    }
    if (type != FTW_F && type != FTW_SL && type != FTW_SLN) return 0;  /* directories, unreadable entries */
    const char *name = strlen(path) > walk.skip ? path + walk.skip : path;
    size_t n = strlen(name) + 1;
    if (walk.len + n > walk.cap) {
        walk.cut = 1;
        return 1;
    }
    memcpy(walk.buf + walk.len, name, n);
    walk.len += n;
    return 0;
}

/* The walk of a FIND payload (u32 cap, root, NUL, paths each NUL-terminated) into walk.buf (send_walk sends and
 * frees it): NULL, or what stopped it before it began. */
static const char *walk_paths(const char *p, size_t len) {
    uint32_t cap;
    const char *end = p + len, *root = p + 4;
    const char *stop = len > 4 ? memchr(root, '\0', (size_t)(end - root)) : NULL;
    walk.buf = NULL;
    if (!stop) return "find: no root";
    memcpy(&cap, p, 4);
    walk.buf = malloc(cap ? cap : 1);
    if (!walk.buf) return "find: out of memory";
    walk.len = 0;
    walk.cap = cap;
    walk.skip = (size_t)(stop - root) + 1;
    walk.deadline = now_ms() + FIND_BUDGET_MS;
    walk.visited = 0;
    walk.cut = 0;
    char full[4096];
    for (const char *q = stop + 1; q < end && !walk.cut;) {
        const char *next = memchr(q, '\0', (size_t)(end - q));
        if (!next) break;
        if (snprintf(full, sizeof full, "%s/%s", root, q) < (int)sizeof full)
            nftw(full, find_visit, 16, FTW_PHYS);  /* a path that does not exist: nothing to report */
        q = next + 1;
    }
    return NULL;
}

static void send_walk(uint8_t type, uint32_t id) {
    for (size_t off = 0; off < walk.len; off += CHUNK)
        send_frame(type, id, walk.buf + off, walk.len - off < CHUNK ? walk.len - off : CHUNK);
    free(walk.buf);
    walk.buf = NULL;
}

static void find_paths(uint32_t id, const char *p, size_t len) {
    const char *problem = walk_paths(p, len);
    if (problem) {
        send_frame(T_ERROR, id, problem, strlen(problem));
        return;
    }
    send_walk(T_STDOUT, id);
    char payload[5] = {0, 0, 0, 0, walk.cut ? F_OUT_TRUNC : 0};
    send_frame(T_EXIT, id, payload, 5);
}

/* IDENTIFY: a guest restored from a template is a copy of it; this makes it its own without starting a process
 * (a shell and cat cost ~100 ms in a restored TCG guest, which translates every new binary's code afresh). */
static void identify(uint32_t id, const char *p, size_t len) {
    const char *end = memchr(p, 0, len);
    const char *problem = NULL;
    if (!end) problem = "IDENTIFY: no hostname";
    else if (sethostname(p, (size_t)(end - p)) < 0) problem = "IDENTIFY: sethostname failed";
    size_t entropy = end ? len - (size_t)(end + 1 - p) : 0;
    if (!problem && entropy > 0) {
        struct rand_pool_info *pool = malloc(sizeof *pool + entropy);
        int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
        if (!pool || fd < 0) problem = "IDENTIFY: cannot open /dev/urandom";
        else {
            pool->entropy_count = (int)(entropy * 8);
            pool->buf_size = (int)entropy;
            memcpy(pool->buf, end + 1, entropy);
            /* credited (it is the host's), or at least mixed in where crediting is not allowed */
            if (ioctl(fd, RNDADDENTROPY, pool) < 0 && write_all(fd, end + 1, entropy) < 0)
                problem = "IDENTIFY: cannot add entropy";
            /* New input is drawn into the output generator only at its next reseed, which a fresh-booted kernel
             * schedules seconds apart: until then this copy and every other restore of the template gave the
             * same /dev/urandom bytes (seen as a failing test under load). Reseed now. */
            else if (ioctl(fd, RNDRESEEDCRNG) < 0)
                problem = "IDENTIFY: cannot reseed the kernel's random generator (RNDRESEEDCRNG)";
        }
        if (fd >= 0) close(fd);
        free(pool);
    }
    if (problem) send_frame(T_ERROR, id, problem, strlen(problem));
    else send_frame(T_PONG, id, NULL, 0);
}

static void finish_job(int idx) {
    struct job *j = jobs[idx];
    if (j->out_fd >= 0) drain(j, &j->out_fd, &j->out_sent, F_OUT_TRUNC, T_STDOUT);
    if (j->err_fd >= 0) drain(j, &j->err_fd, &j->err_sent, F_ERR_TRUNC, T_STDERR);
    /* Background children may hold the pipes open; the command is done when its process is. */
    if (j->out_fd >= 0) close(j->out_fd);
    if (j->err_fd >= 0) close(j->err_fd);
    close_stdin(j);
    /* The walk the edge's audit would ask for next, done now: its answer rides on the exit, one round trip less. */
    if (j->walk_req) {
        if (!walk_paths(j->walk_req, j->walk_req_len)) {
            send_walk(T_FOUND, j->id);
            j->flags |= F_WALKED | (walk.cut ? F_WALK_CUT : 0);
        }
        free(j->walk_req);
    }
    char payload[5 + 12];
    size_t size = 5;
    int32_t code = WIFEXITED(j->status) ? WEXITSTATUS(j->status) : -WTERMSIG(j->status);
    memcpy(payload, &code, 4);
    if (j->ipc_after && alone()) {  /* the edge's IPC_QUERY after a pooled call, answered without its round trip */
        uint32_t counts[3];
        count_ipc(counts);
        memcpy(payload + 5, counts, sizeof counts);
        size += sizeof counts;
        j->flags |= F_IPC_ALONE;
    }
    payload[4] = (char)j->flags;
    send_frame(T_EXIT, j->id, payload, size);
    free(j);
    jobs[idx] = jobs[--njobs];
}


static void handle_frame(uint8_t type, uint32_t id, const char *p, size_t len) {
    struct job *j;
    switch (type) {
    case T_EXEC:
        start_job(id, p, len);
        break;
    case T_STDIN:
        if ((j = find_job(id))) add_stdin(j, p, len);
        break;
    case T_SIGNAL:
        if ((j = find_job(id)) && len >= 4) {
            uint32_t sig;
            memcpy(&sig, p, 4);
            kill(-j->pid, (int)sig);
            kill(j->pid, (int)sig);
        }
        break;
    case T_RESIZE:
        if ((j = find_job(id)) && j->terminal && j->in_fd >= 0 && len >= 4) {
            uint16_t size[2];
            memcpy(size, p, sizeof size);
            struct winsize ws = {.ws_row = size[0], .ws_col = size[1]};
            ioctl(j->in_fd, TIOCSWINSZ, &ws);  /* the kernel sends SIGWINCH to the terminal's foreground group */
        }
        break;
    case T_PING:
        send_frame(T_PONG, id, p, len);
        break;
    case T_KILL_ALL:
        /* In its own PID namespace, kill(-1) reaches every process but the caller and init. */
        kill(-1, SIGKILL);
        send_frame(T_PONG, id, NULL, 0);
        break;
    case T_IPC_QUERY:
        send_ipc_counts(id);
        break;
    case T_FIND:
        find_paths(id, p, len);
        break;
    case T_IDENTIFY:
        identify(id, p, len);
        break;
    default:
        break;
    }
}

static void read_ctl(void) {
    if (rcap - rlen < CHUNK) {
        rcap = rcap ? rcap * 2 : 4 * CHUNK;
        rbuf = realloc(rbuf, rcap);
    }
    ssize_t n = read(ctl, rbuf + rlen, rcap - rlen);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) {
        disconnect();
        rlen = 0;
        return;
    }
    rlen += (size_t)n;
    size_t off = 0;
    while (rlen - off >= 9) {
        uint32_t total;
        memcpy(&total, rbuf + off, 4);
        if (total < 5 || total > MAX_FRAME) {
            disconnect();
            rlen = 0;
            return;
        }
        if (rlen - off < 4 + (size_t)total) break;
        uint32_t id;
        memcpy(&id, rbuf + off + 5, 4);
        handle_frame((uint8_t)rbuf[off + 4], id, rbuf + off + 9, total - 5);
        off += 4 + total;
    }
    memmove(rbuf, rbuf + off, rlen - off);
    rlen -= off;
}

static void greet(void) {
    uint32_t hello[2] = {AGENT_VERSION, (uint32_t)getpid()};
    send_frame(T_HELLO, 0, hello, sizeof hello);
}

/* Guest mode: SIGIO (read through the signalfd) when the host end connects or goes, while nobody is connected:
 * the port reports POLLHUP all that time, so poll alone cannot wait for it. Off while connected, where the port
 * would raise one for every frame that arrives. */
static void watch_host(int on) {
    int flags = fcntl(dev_fd, F_GETFL);
    if (flags >= 0) fcntl(dev_fd, F_SETFL, on ? flags | O_ASYNC : flags & ~O_ASYNC);
}

/* Guest mode: once the host end is connected (the port no longer reports POLLHUP), greet it. */
static void reconnect_dev(void) {
    if (dev_fd < 0) {
        dev_fd = open(ctl_dev, O_RDWR | O_CLOEXEC);
        if (dev_fd < 0) return;
        fcntl(dev_fd, F_SETOWN, getpid());
    }
    watch_host(1);  /* before looking: a host that connects right after the look still wakes us */
    struct pollfd p = {.fd = dev_fd, .events = POLLIN};
    if (poll(&p, 1, 0) < 0 || (p.revents & POLLHUP)) return;
    watch_host(0);
    ctl = dev_fd;
    rlen = 0;
    greet();
}

/* gVisor mode: connect to the edge's listening socket when it is there (a checkpoint must hold no host socket,
 * so the edge lets the agent go before one and listens again after it, or in the restored sandbox). */
static void reconnect_path(void) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    strncpy(addr.sun_path, ctl_path, sizeof addr.sun_path - 1);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
        close(fd);
        return;
    }
    ctl = fd;
    rlen = 0;
    greet();
}

int main(int argc, char **argv) {
    const char *tool = NULL, *shm_dir = NULL;
    int new_privs_allowed = 0;
    ctl = 3;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--fd") == 0) ctl = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--new-privs") == 0) new_privs_allowed = strcmp(argv[i + 1], "allowed") == 0;
        else if (strcmp(argv[i], "--dev") == 0) ctl_dev = argv[i + 1];
        else if (strcmp(argv[i], "--connect") == 0) ctl_path = argv[i + 1];
        else if (strcmp(argv[i], "--root") == 0) sandbox_root = argv[i + 1];
        else if (strcmp(argv[i], "--tool") == 0) tool = argv[i + 1];
        else if (strcmp(argv[i], "--shm") == 0) shm_dir = argv[i + 1];
    }
    /* A crun sandbox's /dev/shm is a directory of its /dev tmpfs, not a tmpfs of its own: every superblock costs
       every memory cgroup of the node (oci.py). Made here, as init, before any command runs. */
    if (shm_dir && mkdir(shm_dir, 01777) == 0) chmod(shm_dir, 01777);  /* mkdir's mode went through the umask */
    if (tool) tool_fd = open(tool, O_RDONLY | O_CLOEXEC);
    if (ctl_dev || ctl_path) ctl = -1;
    prctl(PR_SET_DUMPABLE, 0);
    /* `crun exec` (a re-attached agent) does not set no_new_privs; every command must inherit it, unless the
       sandbox allows setuid programs (`--new-privs allowed`: sudo; its seccomp filter and capability bounding set
       stay, installed by the runtime and corral-launch). */
    if (!new_privs_allowed) prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
    if (ctl >= 0) fcntl(ctl, F_SETFD, FD_CLOEXEC);
    signal(SIGPIPE, SIG_IGN);
    /* A clean shutdown signals every process of the sandbox; a re-attached agent (not PID 1, which the
       kernel already shields) must outlive it to report the end. Commands get the defaults back. */
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGIO);  /* guest mode: the host end of the port (dis)connected */
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    int is_init = getpid() == 1;
    if (ctl_dev) reconnect_dev();
    else if (ctl_path) reconnect_path();
    else greet();

    struct pollfd pfds[2 + 3 * MAX_JOBS];
    struct job *owner[2 + 3 * MAX_JOBS];
    for (;;) {
        if (ctl < 0 && !is_init && !ctl_dev && !ctl_path) break;  /* an attached agent ends with its edge */
        if (ctl < 0 && ctl_dev) reconnect_dev();
        if (ctl < 0 && ctl_path) reconnect_path();
        int n = 0;
        pfds[n] = (struct pollfd){.fd = sfd, .events = POLLIN};
        owner[n++] = NULL;
        pfds[n] = (struct pollfd){.fd = ctl, .events = POLLIN};
        owner[n++] = NULL;
        int64_t now = now_ms(), wait_ms = -1;
        for (int i = 0; i < njobs; i++) {
            struct job *j = jobs[i];
            if (j->out_fd >= 0) { pfds[n] = (struct pollfd){.fd = j->out_fd, .events = POLLIN}; owner[n++] = j; }
            if (j->err_fd >= 0) { pfds[n] = (struct pollfd){.fd = j->err_fd, .events = POLLIN}; owner[n++] = j; }
            if (j->in_fd >= 0 && j->in_off < j->in_len) {
                pfds[n] = (struct pollfd){.fd = j->in_fd, .events = POLLOUT};
                owner[n++] = j;
            }
            if (j->deadline_ms && !j->exited) {
                int64_t left = j->deadline_ms - now;
                if (left < 0) left = 0;
                if (wait_ms < 0 || left < wait_ms) wait_ms = left;
            }
        }
        /* look for the host; in guest mode SIGIO says when it comes, this is the fallback */
        if (ctl < 0 && (ctl_dev || ctl_path) && (wait_ms < 0 || wait_ms > 50)) wait_ms = 50;
        int r = poll(pfds, (nfds_t)n, (int)wait_ms);
        if (r < 0 && errno != EINTR) break;
        if (r > 0) {
            if (pfds[0].revents) {
                struct signalfd_siginfo si;
                while (read(sfd, &si, sizeof si) == sizeof si) {}
            }
            for (int k = 2; k < n; k++) {
                struct job *j = owner[k];
                if (!pfds[k].revents) continue;
                if (pfds[k].fd == j->out_fd) drain(j, &j->out_fd, &j->out_sent, F_OUT_TRUNC, T_STDOUT);
                else if (pfds[k].fd == j->err_fd) drain(j, &j->err_fd, &j->err_sent, F_ERR_TRUNC, T_STDERR);
                else if (pfds[k].fd == j->in_fd) flush_stdin(j);
            }
            if (ctl >= 0 && pfds[1].revents) read_ctl();
        }
        reap();
        now = now_ms();
        for (int i = 0; i < njobs; i++) {
            struct job *j = jobs[i];
            if (j->deadline_ms && !j->exited && now >= j->deadline_ms) {
                j->flags |= F_TIMED_OUT;
                j->deadline_ms = 0;
                kill(-j->pid, SIGKILL);
                kill(j->pid, SIGKILL);
            }
        }
        for (int i = njobs - 1; i >= 0; i--)
            if (jobs[i]->exited) finish_job(i);
    }
    return 0;
}
