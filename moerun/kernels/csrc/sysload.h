#ifndef MOERUN_SYSLOAD_H
#define MOERUN_SYSLOAD_H

/* Runnable threads of other processes, from /proc (Linux); -1 where that cannot be read. */
int qk_others_runnable(void);

#endif
