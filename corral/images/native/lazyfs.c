/* corral-lazyfs: one layer file whose chunks are filled on first read.
 *
 * Serves a FUSE filesystem with one read-only file, /layer.erofs, backed by a
 * sparse local copy (DATA). The kernel mounts EROFS from that file; a read of
 * a chunk not yet present is asked of the parent (the node's server) over a
 * pipe, and answered only after the parent has fetched the chunk, checked it
 * against the layer's chunk digest list and written it into DATA. So this
 * helper never sees the network and never decides what is trusted: it serves
 * bytes that are present and refuses (EIO) everything else.
 *
 *   corral-lazyfs MOUNTPOINT DATA SIZE_BYTES CHUNK_BYTES PRESENT TIMEOUT_MS
 *
 * PRESENT: one byte per chunk (1 = present), kept by the parent; read once at
 * start. Protocol, one line each way:
 *   helper -> parent (stdout): "R"                 mounted and serving
 *                              "F <pid> <c> <c>.." fetch these chunks (pid: the reader)
 *   parent -> helper (stdin):  "O <c>" / "E <c>"   chunk c is present / failed
 * A read waits at most TIMEOUT_MS for its chunks, then fails with EIO; so does
 * any read after the parent is gone. When the parent's end of stdin closes the
 * helper unmounts and exits, so nothing outlives the server that started it.
 * Single-threaded on purpose: chunks are fetched in parallel by the parent,
 * and one loop needs no locks around the present map.
 */
#define FUSE_USE_VERSION 31
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
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define FILE_NAME "layer.erofs"
#define MAX_LINE 128

static int data_fd = -1;
static uint64_t size_bytes, chunk_bytes, chunk_count;
static unsigned char *present;
static long timeout_ms;
static int parent_gone;
static char in_buf[1 << 16];
static size_t in_len;

static long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

static int write_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Apply every complete answer line in in_buf; failed[c - first] is set for "E c" within the range. */
static void apply_answers(uint64_t first, uint64_t last, unsigned char *failed) {
    size_t start = 0;
    for (size_t i = 0; i < in_len; i++) {
        if (in_buf[i] != '\n') continue;
        in_buf[i] = '\0';
        char kind = in_buf[start];
        uint64_t chunk = strtoull(in_buf + start + 1, NULL, 10);
        if (chunk < chunk_count) {
            if (kind == 'O') present[chunk] = 1;
            else if (kind == 'E' && chunk >= first && chunk <= last) failed[chunk - first] = 1;
        }
        start = i + 1;
    }
    memmove(in_buf, in_buf + start, in_len - start);
    in_len -= start;
}

/* 0 once chunks first..last are all present; -1 (EIO for the reader) on failure or timeout. */
static int ensure_chunks(uint64_t first, uint64_t last, pid_t reader) {
    uint64_t missing = 0;
    for (uint64_t c = first; c <= last; c++) missing += !present[c];
    if (missing == 0) return 0;
    if (parent_gone) return -1;

    size_t cap = 32 + (size_t)missing * 24, len = 0;
    char *line = malloc(cap);
    unsigned char *failed = calloc(last - first + 1, 1);
    if (line == NULL || failed == NULL) {
        free(line);
        free(failed);
        return -1;
    }
    len += (size_t)snprintf(line, cap, "F %d", (int)reader);
    for (uint64_t c = first; c <= last; c++)
        if (!present[c]) len += (size_t)snprintf(line + len, cap - len, " %llu", (unsigned long long)c);
    line[len++] = '\n';
    int rc = write_all(STDOUT_FILENO, line, len);
    free(line);
    if (rc != 0) parent_gone = 1;

    long deadline = now_ms() + timeout_ms;
    while (!parent_gone) {
        int waiting = 0, refused = 0;
        for (uint64_t c = first; c <= last; c++) {
            waiting += !present[c] && !failed[c - first];
            refused += failed[c - first];
        }
        if (waiting == 0 || refused) break;
        long left = deadline - now_ms();
        if (left <= 0) break;
        struct pollfd p = {.fd = STDIN_FILENO, .events = POLLIN};
        int ready = poll(&p, 1, (int)left);
        if (ready < 0 && errno == EINTR) continue;
        if (ready <= 0) break;
        ssize_t n = read(STDIN_FILENO, in_buf + in_len, sizeof in_buf - in_len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            parent_gone = 1;
            break;
        }
        in_len += (size_t)n;
        apply_answers(first, last, failed);
    }
    free(failed);
    for (uint64_t c = first; c <= last; c++)
        if (!present[c]) return -1;
    return 0;
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

/* Waits for the parent's end of stdin to close (POLLHUP needs no events), then stops the loop. */
static void *watch_parent(void *arg) {
    (void)arg;
    struct pollfd p = {.fd = STDIN_FILENO, .events = 0};
    while (poll(&p, 1, -1) < 0 && errno == EINTR) {
    }
    kill(getpid(), SIGTERM); /* the loop's handler (fuse_set_signal_handlers) ends it */
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s MOUNTPOINT DATA SIZE_BYTES CHUNK_BYTES PRESENT TIMEOUT_MS\n", argv[0]);
        return 2;
    }
    size_bytes = strtoull(argv[3], NULL, 10);
    chunk_bytes = strtoull(argv[4], NULL, 10);
    timeout_ms = strtol(argv[6], NULL, 10);
    if (chunk_bytes == 0 || timeout_ms <= 0) {
        fprintf(stderr, "corral-lazyfs: CHUNK_BYTES and TIMEOUT_MS must be positive\n");
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

    char *fuse_argv[] = {argv[0], "-o", "ro,allow_other,fsname=corral-lazyfs,subtype=corral-lazyfs", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fuse_argv);
    struct fuse *fuse = fuse_new(&args, &ops, sizeof ops, NULL);
    if (fuse == NULL) return 1;
    if (fuse_mount(fuse, argv[1]) != 0) {
        fuse_destroy(fuse);
        return 1;
    }
    struct fuse_session *session = fuse_get_session(fuse);
    if (fuse_set_signal_handlers(session) != 0) return 1;
    sigset_t term;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &term, NULL); /* the watcher's SIGTERM goes to the loop's thread */
    pthread_t watcher;
    pthread_create(&watcher, NULL, watch_parent, NULL);
    pthread_sigmask(SIG_UNBLOCK, &term, NULL);
    int rc = write_all(STDOUT_FILENO, "R\n", 2) == 0 ? fuse_loop(fuse) : 1;
    fuse_remove_signal_handlers(session);
    fuse_unmount(fuse);
    fuse_destroy(fuse);
    return rc == 0 ? 0 : 1;
}
