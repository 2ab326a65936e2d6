/* How many threads of other processes are runnable now (moerun.model.ops.FreeCpus): /proc/loadavg's machine-wide
 * count of runnable threads less this process's own running ones (/proc/self/task/N/stat, state R). In C because a
 * decode step takes a reading every other token or so, and Python's file objects made that ~0.2 ms from cold
 * caches (after a step has streamed the weights through them); here it is a handful of system calls. */
#define _GNU_SOURCE
#include "sysload.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Up to n - 1 bytes of the file at path, NUL-terminated; -1 if it cannot be read. */
static int read_small(const char *path, char *buf, int n) {
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    const ssize_t got = read(fd, buf, (size_t)n - 1);
    close(fd);
    if (got <= 0) return -1;
    buf[got] = 0;
    return (int)got;
}

int qk_others_runnable(void) {
    char buf[512];
    if (read_small("/proc/loadavg", buf, sizeof buf) < 0) return -1;
    /* "0.41 0.83 0.94 3/412 12345": the fourth field's numerator */
    const char *p = buf;
    for (int field = 0; field < 3; field++) {
        p = strchr(p, ' ');
        if (!p) return -1;
        p++;
    }
    char *end;
    const long runnable = strtol(p, &end, 10);
    if (end == p || *end != '/') return -1;
    DIR *d = opendir("/proc/self/task");
    if (!d) return -1;
    long mine = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        char path[300];
        snprintf(path, sizeof path, "/proc/self/task/%s/stat", e->d_name);
        if (read_small(path, buf, sizeof buf) < 0) continue; /* a thread that just ended */
        const char *close_paren = strrchr(buf, ')'); /* the name may hold spaces and parentheses */
        if (close_paren && close_paren[1] == ' ' && close_paren[2] == 'R') mine++;
    }
    closedir(d);
    return runnable > mine ? (int)(runnable - mine) : 0;
}
