/*
 * fd_passing.h — a descriptor and a small message sent over a Unix socket (SCM_RIGHTS), for the
 * tests in which a second process maps what the first one exported. REQUIRE fails the test on
 * any short or refused transfer.
 */
#ifndef KVA_TEST_FD_PASSING_H
#define KVA_TEST_FD_PASSING_H

#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "check.h"

static void send_fd(int sock, int fd, const void *message, size_t length) {
    char control[CMSG_SPACE(sizeof(int))];
    memset(control, 0, sizeof control);
    struct iovec iov = {.iov_base = (void *)message, .iov_len = length};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof control};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    REQUIRE(sendmsg(sock, &msg, 0) == (ssize_t)length);
}

/* The descriptor sent with the message (close on exec); the message goes to message. */
static int receive_fd(int sock, void *message, size_t length) {
    char control[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {.iov_base = message, .iov_len = length};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof control};
    REQUIRE(recvmsg(sock, &msg, MSG_CMSG_CLOEXEC) == (ssize_t)length);
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    REQUIRE(c && c->cmsg_type == SCM_RIGHTS);
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

/* Runs this test's executable again as the second process, `self --ROLE SOCKET [extra]`, with
 * one end of a new socket pair (its number as SOCKET); returns the child's pid and the other end
 * in *sock. extra may be NULL. */
static pid_t start_peer(const char *self, const char *role, const char *extra, int *sock) {
    int socks[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, socks) == 0);
    fflush(stderr);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        close(socks[0]);
        char arg[16];
        snprintf(arg, sizeof arg, "%d", socks[1]);
        execl(self, self, role, arg, extra, (char *)NULL);
        _exit(127);
    }
    close(socks[1]);
    *sock = socks[0];
    return pid;
}

#endif
