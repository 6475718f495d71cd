/*
 * memhog: the workload of bench/checkpoint_restore.py and bench/across_nodes.py, built with
 * `gcc -static -O2` and put into a one-file image.
 *
 * Allocates MIB mebibytes (argv[1], default 1024) and writes every page: the first
 * half of each 4 KiB page is pseudo-random (xorshift64*, incompressible), the second
 * half a repeated 64-byte pattern (compressible), so compression matters but is not
 * trivial. Then it keeps a checksum of the whole buffer and loops forever, every
 * 100 ms replacing /hb with "<nonce> <beat>\n" (open, write, close: no file stays
 * open for CRIU to deal with). The nonce is drawn once at start: a restored process
 * keeps it and keeps counting, a cold start would not.
 *
 * When the wall clock jumps by more than a second between two beats (the process
 * was frozen, dumped and restored), it re-reads the whole buffer and appends
 * "verify <beat> ok|BAD <checksum>\n" to /verify: proof that the memory came back.
 *
 * SIGUSR1 (bench/across_nodes.py) makes it rewrite one contiguous tenth of its buffer,
 * starting at the middle, with fresh pages of the same shape, take the new checksum
 * and append "rewrote <MiB> MiB at <MiB> checksum <checksum>\n" to /verify: the next
 * checkpoint then differs from the last one in that region only.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096

static uint64_t xorshift(uint64_t *s) {
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1DULL;
}

static volatile sig_atomic_t rewrite_requested;

static void on_sigusr1(int sig) {
    (void)sig;
    rewrite_requested = 1;
}

static void fill_pages(uint8_t *buf, size_t size, uint64_t *seed) {
    static const char pattern[64] = "cedana-bench memhog: the compressible half of every page 0123\n";
    for (size_t off = 0; off < size; off += PAGE) {
        uint64_t *random_half = (uint64_t *)(buf + off);
        for (size_t i = 0; i < PAGE / 2 / sizeof(uint64_t); i++) {
            random_half[i] = xorshift(seed);
        }
        for (size_t i = PAGE / 2; i < PAGE; i += 64) {
            memcpy(buf + off + i, pattern, 64);
        }
    }
}

static uint64_t checksum(const uint64_t *words, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) {
        h = (h ^ words[i]) * 1099511628211ULL;
    }
    return h;
}

static void write_file(const char *path, const char *tmp, const char *text, int append) {
    const char *target = append ? path : tmp;
    int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (append ? O_APPEND : O_TRUNC);
    int fd = open(target, flags, 0644);
    if (fd < 0) {
        return;
    }
    ssize_t ignored = write(fd, text, strlen(text));
    (void)ignored;
    close(fd);
    if (!append) {
        rename(tmp, path);
    }
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 1024;
    size_t size = mib << 20;
    uint8_t *buf = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t seed = (uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ULL ^ (uint64_t)getpid() ^ 0xC0FFEE;
    uint64_t nonce = xorshift(&seed);
    fill_pages(buf, size, &seed);
    uint64_t sum = checksum((const uint64_t *)buf, size / sizeof(uint64_t));

    char line[160];
    snprintf(line, sizeof line, "filled %zu MiB checksum %016llx nonce %016llx\n", mib,
             (unsigned long long)sum, (unsigned long long)nonce);
    write_file("/verify", NULL, line, 1);
    signal(SIGUSR1, on_sigusr1);

    double last = now_s();
    for (unsigned long long beat = 1;; beat++) {
        /* The beat comes first, so that after a restore it is the first thing the
         * program does (a restore's time to first instruction, bench/restore_scaling.py):
         * the verification below reads the whole buffer, which a lazy restore is still
         * bringing in. The clock is read after it: a dump that froze the program between
         * reading the clock and `last` below would hide the gap. */
        snprintf(line, sizeof line, "%016llx %llu\n", (unsigned long long)nonce, beat);
        write_file("/hb", "/hb.tmp", line, 0);
        double t = now_s();
        if (t - last > 1.0) {
            uint64_t again = checksum((const uint64_t *)buf, size / sizeof(uint64_t));
            snprintf(line, sizeof line, "verify %llu %s %016llx after %.1fs gap\n", beat,
                     again == sum ? "ok" : "BAD", (unsigned long long)again, t - last);
            write_file("/verify", NULL, line, 1);
        }
        if (rewrite_requested) {
            rewrite_requested = 0;
            size_t start = size / 2 / PAGE * PAGE;
            size_t length = (size / 10 + PAGE - 1) / PAGE * PAGE;
            fill_pages(buf + start, length, &seed);
            sum = checksum((const uint64_t *)buf, size / sizeof(uint64_t));
            snprintf(line, sizeof line, "rewrote %zu MiB at %zu MiB checksum %016llx\n",
                     length >> 20, start >> 20, (unsigned long long)sum);
            write_file("/verify", NULL, line, 1);
        }
        last = now_s();
        struct timespec nap = {0, 100 * 1000 * 1000};
        nanosleep(&nap, NULL);
    }
}
