/* corral-lazyfs: one layer file whose chunks are filled on first read.
 *
 * Serves a FUSE filesystem with one read-only file, /layer.erofs, backed by a
 * sparse local copy (DATA). The kernel mounts EROFS from that file; a read of
 * a chunk not yet present is asked of the node's server over a Unix socket,
 * and answered only after the server has fetched the chunk, checked it against
 * the layer's chunk digest list and written it into DATA. So this helper never
 * sees the network and never decides what is trusted: it serves bytes that are
 * present and refuses (EIO) everything else.
 *
 *   corral-lazyfs MOUNTPOINT DATA SIZE_BYTES CHUNK_BYTES PRESENT TIMEOUT_MS SOCKET ORPHAN_MS
 *
 * PRESENT: one byte per chunk (1 = present), kept by the server; read once at
 * start. SOCKET: where this helper listens (in a directory only root can enter;
 * only root peers are served). It outlives the server that started it: a
 * server that dies (an edge killed) leaves the sandboxes that read through
 * this mount running, and the next server connects here again and answers;
 * one that connects while another is connected takes over (the older one hangs,
 * or a process that outlived it holds its end).
 * Protocol, one line each way, per connection:
 *   helper -> server: "R <dev>"           mounted and serving; dev: st_dev of MOUNTPOINT
 *                     "F <pid> <c> <c>.." fetch these chunks (pid: the reader)
 *   server -> helper: "O <c>" / "E <c>"   chunk c is present / failed
 *                     "Q"                 unmount and exit
 * A read waits at most TIMEOUT_MS for its chunks, then fails with EIO; a read
 * waiting while no server is connected asks again of the next one. With no
 * server for ORPHAN_MS the helper unmounts and exits (nobody came back for it);
 * it exits too once its mount is gone. Reads are served by one loop (the
 * present map has one writer per chunk: the connection thread) and chunks are
 * fetched in parallel by the server.
 */
#define FUSE_USE_VERSION 31
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <fuse.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define FILE_NAME "layer.erofs"

static int data_fd = -1;
static uint64_t size_bytes, chunk_bytes, chunk_count;
static unsigned char *present;
static long timeout_ms, orphan_ms;
static unsigned long long mount_dev;
static int listen_fd = -1;

/* The connection to the server and the read waiting on it, shared by the FUSE loop and the connection thread. */
static pthread_mutex_t mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t answered = PTHREAD_COND_INITIALIZER;
static int conn_fd = -1;
static char *pending_line; /* the waiting read's "F ..." line: sent again to a server that connects */
static size_t pending_len;
static uint64_t pending_first, pending_last;
static unsigned char *pending_failed; /* "E c" for a chunk of the waiting read */

static long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

static int write_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Apply one answer line (under the mutex); 1 if it says quit. */
static int apply_answer(const char *line) {
    if (line[0] == 'Q') return 1;
    uint64_t chunk = strtoull(line + 1, NULL, 10);
    if (chunk < chunk_count) {
        if (line[0] == 'O') present[chunk] = 1;
        else if (line[0] == 'E' && pending_failed != NULL && chunk >= pending_first && chunk <= pending_last)
            pending_failed[chunk - pending_first] = 1;
    }
    return 0;
}

/* A server that connects (root only), greeted and sent the waiting read's request, under the mutex; -1 if it
 * was not taken (another uid, or it went at once). */
static int accept_server(void) {
    int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) return -1;
    struct ucred peer;
    socklen_t peer_len = sizeof peer;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &peer_len) != 0 || peer.uid != 0) {
        close(fd);
        return -1;
    }
    char hello[64];
    int hello_len = snprintf(hello, sizeof hello, "R %llu\n", mount_dev);
    if (write_all(fd, hello, (size_t)hello_len) != 0 ||
        (pending_line != NULL && write_all(fd, pending_line, pending_len) != 0)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* The connection thread: accepts a server, applies its answers; when it goes, waits for the next one, for at
 * most ORPHAN_MS. A server that connects while one is connected takes over: the newer one is the node's now
 * (the old one hangs, or a process that outlived it holds its end). ARG: the mountpoint. */
static void *serve_connections(void *arg) {
    const char *mountpoint = arg;
    struct stat st;
    if (stat(mountpoint, &st) != 0) { /* answered by the FUSE loop, which runs by now */
        kill(getpid(), SIGTERM);
        return NULL;
    }
    mount_dev = (unsigned long long)st.st_dev;
    static char buf[1 << 16];
    size_t len = 0;
    long orphaned_at = now_ms();
    for (;;) {
        struct pollfd p[2] = {{.fd = listen_fd, .events = POLLIN}, {.fd = conn_fd, .events = POLLIN}};
        int timeout = -1;
        if (conn_fd < 0) {
            long left = orphaned_at + orphan_ms - now_ms();
            if (left <= 0) break;
            timeout = left > 60000 ? 60000 : (int)left;
        }
        int ready = poll(p, conn_fd < 0 ? 1 : 2, timeout);
        if (ready <= 0) continue;
        if (p[0].revents & POLLIN) {
            pthread_mutex_lock(&mutex);
            int fd = accept_server();
            if (fd >= 0) {
                if (conn_fd >= 0) close(conn_fd); /* its half-read answers go with it: the new one is asked again */
                conn_fd = fd;
                len = 0;
            }
            pthread_mutex_unlock(&mutex);
            continue;
        }
        if (conn_fd < 0 || !(p[1].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        ssize_t n = read(conn_fd, buf + len, sizeof buf - len);
        if (n < 0 && errno == EINTR) continue;
        pthread_mutex_lock(&mutex);
        if (n <= 0) { /* the server went away (or closed its end): wait for the next one */
            close(conn_fd);
            conn_fd = -1;
            orphaned_at = now_ms();
            pthread_mutex_unlock(&mutex);
            continue;
        }
        len += (size_t)n;
        size_t start = 0;
        int quit = 0;
        for (size_t i = 0; i < len; i++) {
            if (buf[i] != '\n') continue;
            buf[i] = '\0';
            quit |= apply_answer(buf + start);
            start = i + 1;
        }
        memmove(buf, buf + start, len - start);
        len -= start;
        if (len == sizeof buf) len = 0; /* a line longer than the buffer: not ours */
        pthread_cond_broadcast(&answered);
        pthread_mutex_unlock(&mutex);
        if (quit) break;
    }
    kill(getpid(), SIGTERM); /* the loop's handler (fuse_set_signal_handlers) ends it: unmount and exit */
    return NULL;
}

/* 0 once chunks first..last are all present; -1 (EIO for the reader) on failure or timeout. */
static int ensure_chunks(uint64_t first, uint64_t last, pid_t reader) {
    pthread_mutex_lock(&mutex);
    uint64_t missing = 0;
    for (uint64_t c = first; c <= last; c++) missing += !present[c];
    if (missing == 0) {
        pthread_mutex_unlock(&mutex);
        return 0;
    }
    size_t cap = 32 + (size_t)missing * 24, len = 0;
    char *line = malloc(cap);
    unsigned char *failed = calloc(last - first + 1, 1);
    if (line == NULL || failed == NULL) {
        pthread_mutex_unlock(&mutex);
        free(line);
        free(failed);
        return -1;
    }
    len += (size_t)snprintf(line, cap, "F %d", (int)reader);
    for (uint64_t c = first; c <= last; c++)
        if (!present[c]) len += (size_t)snprintf(line + len, cap - len, " %llu", (unsigned long long)c);
    line[len++] = '\n';
    pending_line = line, pending_len = len, pending_first = first, pending_last = last, pending_failed = failed;
    if (conn_fd >= 0) write_all(conn_fd, line, len); /* a failed send: the thread sees the connection go */

    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += timeout_ms / 1000;
    deadline.tv_nsec += (timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) deadline.tv_sec += 1, deadline.tv_nsec -= 1000000000L;
    int rc = 0;
    for (;;) {
        int waiting = 0, refused = 0;
        for (uint64_t c = first; c <= last; c++) {
            waiting += !present[c] && !failed[c - first];
            refused += failed[c - first];
        }
        if (refused) rc = -1;
        if (waiting == 0 || refused) break;
        if (pthread_cond_timedwait(&answered, &mutex, &deadline) == ETIMEDOUT) {
            rc = -1;
            break;
        }
    }
    for (uint64_t c = first; c <= last && rc == 0; c++)
        if (!present[c]) rc = -1;
    pending_line = NULL, pending_failed = NULL;
    pthread_mutex_unlock(&mutex);
    free(line);
    free(failed);
    return rc;
}

static int lazy_getattr(const char *path, struct stat *st, struct fuse_file_info *fi) {
    (void)fi;
    memset(st, 0, sizeof *st);
    if (strcmp(path, "/") == 0) {
        st->st_mode = S_IFDIR | 0555;
        st->st_nlink = 2;
    } else if (strcmp(path, "/" FILE_NAME) == 0) {
        st->st_mode = S_IFREG | 0444;
        st->st_nlink = 1;
        st->st_size = (off_t)size_bytes;
    } else {
        return -ENOENT;
    }
    return 0;
}

static int lazy_readdir(const char *path, void *buf, fuse_fill_dir_t fill, off_t off, struct fuse_file_info *fi,
                        enum fuse_readdir_flags flags) {
    (void)off, (void)fi, (void)flags;
    if (strcmp(path, "/") != 0) return -ENOENT;
    fill(buf, ".", NULL, 0, 0);
    fill(buf, "..", NULL, 0, 0);
    fill(buf, FILE_NAME, NULL, 0, 0);
    return 0;
}

static int lazy_open(const char *path, struct fuse_file_info *fi) {
    if (strcmp(path, "/" FILE_NAME) != 0) return -ENOENT;
    if ((fi->flags & O_ACCMODE) != O_RDONLY) return -EROFS;
    fi->keep_cache = 1; /* the file never changes: keep its page cache across opens */
    return 0;
}

static int lazy_read(const char *path, char *buf, size_t size, off_t off, struct fuse_file_info *fi) {
    (void)fi;
    if (strcmp(path, "/" FILE_NAME) != 0) return -ENOENT;
    if (off < 0 || (uint64_t)off >= size_bytes || size == 0) return 0;
    if ((uint64_t)off + size > size_bytes) size = (size_t)(size_bytes - (uint64_t)off);
    if (ensure_chunks((uint64_t)off / chunk_bytes, ((uint64_t)off + size - 1) / chunk_bytes,
                      fuse_get_context()->pid) != 0)
        return -EIO;
    size_t done = 0;
    while (done < size) {
        ssize_t n = pread(data_fd, buf + done, size - done, off + (off_t)done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -EIO;
        done += (size_t)n;
    }
    return (int)done;
}

static void *lazy_init(struct fuse_conn_info *conn, struct fuse_config *cfg) {
    (void)conn;
    cfg->kernel_cache = 1;
    cfg->attr_timeout = 86400.0;
    cfg->entry_timeout = 86400.0;
    return NULL;
}

static const struct fuse_operations ops = {
    .init = lazy_init,
    .getattr = lazy_getattr,
    .readdir = lazy_readdir,
    .open = lazy_open,
    .read = lazy_read,
};

/* Listens on SOCKET (bound through /proc/self/fd: a deep data dir makes paths longer than sun_path). */
static int listen_on(const char *path) {
    char dir[4096];
    const char *slash = strrchr(path, '/');
    if (slash == NULL || (size_t)(slash - path) >= sizeof dir) return -1;
    memcpy(dir, path, (size_t)(slash - path));
    dir[slash - path] = '\0';
    int dir_fd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd < 0) return -1;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    int fd = -1;
    if ((size_t)snprintf(addr.sun_path, sizeof addr.sun_path, "/proc/self/fd/%d/%s", dir_fd, slash + 1) <
        sizeof addr.sun_path) {
        unlink(addr.sun_path);
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd >= 0 && (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(fd, 4) != 0)) {
            close(fd);
            fd = -1;
        }
    }
    close(dir_fd);
    return fd;
}

int main(int argc, char **argv) {
    if (argc != 9) {
        fprintf(stderr, "usage: %s MOUNTPOINT DATA SIZE_BYTES CHUNK_BYTES PRESENT TIMEOUT_MS SOCKET ORPHAN_MS\n",
                argv[0]);
        return 2;
    }
    size_bytes = strtoull(argv[3], NULL, 10);
    chunk_bytes = strtoull(argv[4], NULL, 10);
    timeout_ms = strtol(argv[6], NULL, 10);
    orphan_ms = strtol(argv[8], NULL, 10);
    if (chunk_bytes == 0 || timeout_ms <= 0 || orphan_ms <= 0) {
        fprintf(stderr, "corral-lazyfs: CHUNK_BYTES, TIMEOUT_MS and ORPHAN_MS must be positive\n");
        return 2;
    }
    chunk_count = (size_bytes + chunk_bytes - 1) / chunk_bytes;
    present = calloc(chunk_count ? chunk_count : 1, 1);
    data_fd = open(argv[2], O_RDONLY | O_CLOEXEC);
    int present_fd = open(argv[5], O_RDONLY | O_CLOEXEC);
    if (present == NULL || data_fd < 0 || present_fd < 0) {
        perror("corral-lazyfs: open");
        return 1;
    }
    for (size_t got = 0; got < chunk_count;) {
        ssize_t n = pread(present_fd, present + got, chunk_count - got, (off_t)got);
        if (n <= 0) break; /* a short map: the rest is absent */
        got += (size_t)n;
    }
    close(present_fd);
    for (uint64_t c = 0; c < chunk_count; c++) present[c] = present[c] == 1;
    listen_fd = listen_on(argv[7]);
    if (listen_fd < 0) {
        perror("corral-lazyfs: listen");
        return 1;
    }

    char *fuse_argv[] = {argv[0], "-o", "ro,allow_other,fsname=corral-lazyfs,subtype=corral-lazyfs", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fuse_argv);
    struct fuse *fuse = fuse_new(&args, &ops, sizeof ops, NULL);
    if (fuse == NULL || fuse_mount(fuse, argv[1]) != 0) { /* nothing mounted: no socket left to connect to */
        if (fuse != NULL) fuse_destroy(fuse);
        unlink(argv[7]);
        return 1;
    }
    struct fuse_session *session = fuse_get_session(fuse);
    if (fuse_set_signal_handlers(session) != 0) { /* mounted already: unmount, or it stays and reads ENOTCONN */
        fuse_unmount(fuse);
        fuse_destroy(fuse);
        unlink(argv[7]);
        return 1;
    }
    sigset_t term;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &term, NULL); /* the connection thread's SIGTERM goes to the loop's thread */
    pthread_t connections;
    pthread_create(&connections, NULL, serve_connections, argv[1]);
    pthread_sigmask(SIG_UNBLOCK, &term, NULL);
    int rc = fuse_loop(fuse);
    fuse_remove_signal_handlers(session);
    fuse_unmount(fuse);
    fuse_destroy(fuse);
    unlink(argv[7]);
    return rc == 0 ? 0 : 1;
}
