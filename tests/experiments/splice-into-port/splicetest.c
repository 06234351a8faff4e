// Guest side of the splice experiment (see README.md): fill a pipe with a counter pattern (u64 LE), move it
// into the virtio-serial port, and account for every byte: pipe bytes consumed vs what the call reported.
//
//   splicetest MODE TOTAL CHUNK [PIPE_BYTES] [SPLICE_FLAGS]
//   MODE: splice  splice(pipe -> port, CHUNK) straight from the filled pipe
//         staged  splice(pipe -> staging pipe, CHUNK), then splice(staging -> port) of all of it (the agent's way)
//         write   read(pipe, CHUNK) + write(port): the copying way
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>
#include <stdint.h>
#include <sys/ioctl.h>
#include <time.h>

static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec/1e9;}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "splice";   // splice | write
    long long total = argc > 2 ? atoll(argv[2]) : (64LL << 20);
    size_t chunk = argc > 3 ? (size_t)atol(argv[3]) : (1 << 20);
    int pipesz = argc > 4 ? atoi(argv[4]) : (1 << 20);
    unsigned flags = argc > 5 ? (unsigned)atoi(argv[5]) : 0;
    int port = open("/dev/vport0p1", O_WRONLY);
    if (port < 0) { perror("open port"); return 1; }
    int p[2];
    if (pipe2(p, O_NONBLOCK)) { perror("pipe"); return 1; }
    int got = fcntl(p[1], F_SETPIPE_SZ, pipesz);
    int st[2];
    if (pipe(st)) { perror("pipe"); return 1; }
    fcntl(st[1], F_SETPIPE_SZ, 1 << 20);
    fcntl(p[0], F_SETFL, 0); // read end blocking
    uint64_t counter = 0; // next u64 to write into the pipe (pattern: little-endian counter)
    long long produced = 0, consumed = 0, reported = 0, lost = 0, zero_with_data = 0, calls = 0, short_calls = 0;
    static uint64_t buf[8192];
    char *rbuf = malloc(chunk);
    double t0 = now();
    while (reported < total || produced > consumed) {
        // Fill the pipe (never past `total`).
        while (produced < total) {
            size_t want = sizeof buf;
            if ((long long)want > total - produced) want = total - produced;
            for (size_t i = 0; i < want / 8; i++) buf[i] = counter + i;
            ssize_t w = write(p[1], buf, want);
            if (w < 0) { if (errno == EAGAIN) break; perror("pipe write"); return 1; }
            if (w % 8) { fprintf(stderr, "odd pipe write %zd\n", w); return 1; }
            counter += w / 8; produced += w;
        }
        int before = 0, after = 0;
        ioctl(p[0], FIONREAD, &before);
        if (before == 0) break;
        ssize_t n;
        if (!strcmp(mode, "splice")) {
            n = splice(p[0], NULL, port, NULL, chunk, flags);
        } else if (!strcmp(mode, "staged")) {
            n = splice(p[0], NULL, st[1], NULL, chunk, flags);
            ssize_t left = n;
            while (left > 0) {
                ssize_t m = splice(st[0], NULL, port, NULL, left, flags);
                if (m <= 0) { fprintf(stderr, "staged: port splice returned %zd with %zd staged\n", m, left); return 1; }
                left -= m;
            }
        } else {
            size_t want = chunk < (size_t)before ? chunk : (size_t)before;
            n = read(p[0], rbuf, want);
            if (n > 0) { ssize_t off = 0; while (off < n) { ssize_t w = write(port, rbuf + off, n - off); if (w < 0) { perror("port write"); return 1; } off += w; } }
        }
        calls++;
        if (n < 0) { fprintf(stderr, "splice: %s\n", strerror(errno)); return 1; }
        ioctl(p[0], FIONREAD, &after);
        consumed += before - after;
        reported += n;
        if (n < before && (size_t)n < chunk) short_calls++;
        if (before - after != n) {
            lost += (before - after) - n;
            if (n == 0) zero_with_data++;
            if (lost < (8 << 20)) fprintf(stderr, "call %lld: pipe had %d, consumed %d, splice returned %zd\n", calls, before, before - after, n);
        }
    }
    double dt = now() - t0;
    fprintf(stderr, "RESULT mode=%s pipe=%d chunk=%zu flags=%u produced=%lld consumed=%lld reported=%lld lost=%lld zero_returns_with_data=%lld calls=%lld short=%lld secs=%.3f MB/s=%.1f\n",
            mode, got, chunk, flags, produced, consumed, reported, lost, zero_with_data, calls, short_calls, dt, reported / dt / 1e6);
    return 0;
}
