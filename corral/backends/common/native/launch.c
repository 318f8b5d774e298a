/*
 * corral-launch: run an OCI runtime with the sandbox's root filesystem mounted
 * in a mount namespace of its own.
 *
 * The overlay (writable upper over read-only EROFS lowers) is mounted in a
 * fresh private mount namespace and the runtime is exec'd there, so the mount
 * exists only for the container: it is never visible in the edge's namespace,
 * later containers do not copy it, and it disappears with the container even
 * if the edge crashes.
 *
 * usage: corral-launch [--overlay LOWERS UPPER WORK TARGET] [--ctl-fd N]
 *                      [--oom-score-adj N] [--audit-session] [--refuse-clone3]
 *                      -- RUNTIME ARGS...
 *   LOWERS is a colon-separated lowerdir list, top first.
 *   --ctl-fd N makes fd N the runtime's fd 3 (for --preserve-fds 1).
 *   --oom-score-adj N is set here, with the privilege to lower it, and is
 *   inherited by the container's init (the runtime would set it only after
 *   dropping capabilities, which the kernel refuses for negative values).
 *   Best effort: hosts without CAP_SYS_RESOURCE keep the default, and the
 *   OOM killer still picks the largest process, which is not the agent.
 *   --audit-session starts a new kernel audit session (writing the login uid
 *   gives the process a fresh session id) that the container inherits, so
 *   every audit record of its processes (e.g. a syscall seccomp refused)
 *   names the sandbox even after the process exited. The container lacks
 *   CAP_AUDIT_CONTROL and cannot change it. Best effort, like the OOM score.
 *   --refuse-clone3 installs a seccomp filter of its own, inherited by the
 *   runtime and the container, answering clone3 with ENOSYS (its flags are in
 *   memory, where seccomp cannot check them for new namespaces; glibc then
 *   falls back to clone, whose flags the profile does check). It is kept out
 *   of the profile's filter because that one logs every refusal and glibc
 *   tries clone3 before each thread and spawn. Failing to install it is fatal.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CLONE3_NR 435 /* the same on x86_64, x32 (with the x32 bit) and i386 */
#define X32_SYSCALL_BIT 0x40000000u

static int refuse_clone3(void) {
    struct sock_filter code[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 2, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_I386, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_STMT(BPF_ALU | BPF_AND | BPF_K, ~X32_SYSCALL_BIT),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, CLONE3_NR, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog program = {.len = sizeof(code) / sizeof(code[0]), .filter = code};
    return (int)syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &program);
}

static void die(const char *what, const char *arg) {
    fprintf(stderr, "corral-launch: %s %s: %s\n", what, arg ? arg : "", strerror(errno));
    exit(125);
}

int main(int argc, char **argv) {
    const char *lowers = NULL, *upper = NULL, *work = NULL, *target = NULL;
    int ctl_fd = -1, i = 1;
    const char *oom_score_adj = NULL;
    int audit_session = 0, clone3_refused = 0;
    for (; i < argc; i++) {
        if (strcmp(argv[i], "--") == 0) {
            i++;
            break;
        } else if (strcmp(argv[i], "--overlay") == 0 && i + 4 < argc) {
            lowers = argv[++i];
            upper = argv[++i];
            work = argv[++i];
            target = argv[++i];
        } else if (strcmp(argv[i], "--ctl-fd") == 0 && i + 1 < argc) {
            ctl_fd = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--oom-score-adj") == 0 && i + 1 < argc) {
            oom_score_adj = argv[++i];
        } else if (strcmp(argv[i], "--audit-session") == 0) {
            audit_session = 1;
        } else if (strcmp(argv[i], "--refuse-clone3") == 0) {
            clone3_refused = 1;
        } else {
            errno = EINVAL;
            die("bad argument", argv[i]);
        }
    }
    if (i >= argc) {
        errno = EINVAL;
        die("missing runtime command after", "--");
    }
    if (unshare(CLONE_NEWNS) < 0) die("unshare", "CLONE_NEWNS");
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) die("make private", "/");
    if (lowers) {
        size_t len = strlen(lowers) + strlen(upper) + strlen(work) + 64;
        char *opts = malloc(len);
        snprintf(opts, len, "lowerdir=%s,upperdir=%s,workdir=%s", lowers, upper, work);
        if (mount("overlay", target, "overlay", 0, opts) < 0) die("mount overlay on", target);
        free(opts);
    }
    if (oom_score_adj) {
        int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            (void)!write(fd, oom_score_adj, strlen(oom_score_adj));
            close(fd);
        }
    }
    if (audit_session) {
        int fd = open("/proc/self/loginuid", O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            (void)!write(fd, "0", 1);
            close(fd);
        }
    }
    if (clone3_refused && refuse_clone3() < 0) die("seccomp filter for", "clone3");
    if (ctl_fd >= 0 && ctl_fd != 3) {
        if (dup2(ctl_fd, 3) < 0) die("dup2", "ctl fd");
        close(ctl_fd);
    } else if (ctl_fd == 3) {
        fcntl(3, F_SETFD, 0);
    }
    execvp(argv[i], argv + i);
    die("exec", argv[i]);
    return 125;
}
