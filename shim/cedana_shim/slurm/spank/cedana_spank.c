/*
 * cedana_spank: hands an opted-in Slurm batch step over to the cedana runner.
 *
 * Built by `cedana slurm install --node-role worker` against the node's
 * <slurm/spank.h>; loaded by slurmstepd through one plugstack.conf line:
 *
 *   optional /usr/local/lib/cedana/slurm/cedana_spank.so runner=/path/cedana-slurm-task
 *
 * Why two callbacks (Slurm 22.05, src/slurmd/slurmstepd/mgr.c and task.c): in the
 * forked task, slurm_spank_task_init_privileged runs as root but BEFORE the task's
 * stdio, environment (SLURM_TASK_PID, ...) and process group are set up;
 * slurm_spank_task_init runs after all of that, right before the execve of the
 * script, but as the job's user. So the privileged callback only decides and sets
 * PR_SET_KEEPCAPS (the permitted capabilities survive the switch to the user), and
 * the user callback raises them again, becomes root and execs the runner:
 *
 *   RUNNER --job-id ID --step-id batch --uid UID --gid GID [--gids G1,G2]
 *          --cwd DIR [--config PATH] -- ARGV...
 *
 * with the step's environment plus CEDANA_SLURM=1. --config comes from a
 * `config=/path` argument on the plugstack line (root's file, unlike the job's
 * environment, which the user controls). Anything unexpected before the
 * exec: slurm_error, drop back to the user, and the job runs as it would without
 * us. Only the batch step is handed over (srun steps inside it are Slurm's own).
 */

#define _GNU_SOURCE /* setresuid, setresgid, memfd_create */

#include <errno.h>
#include <grp.h>
#include <limits.h>
#include <linux/capability.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <slurm/slurm.h>
#include <slurm/spank.h>

SPANK_PLUGIN(cedana, 1);

#define MAX_GIDS 1024

/* Set by the privileged callback in this very task process (a fork of slurmstepd). */
static int hand_over;

/* The value of a plugstack argument KEY=/absolute/path, or NULL. */
static const char *path_arg(int ac, char **av, const char *key)
{
	size_t len = strlen(key);

	for (int i = 0; i < ac; i++)
		if (strncmp(av[i], key, len) == 0 && av[i][len] == '=' && av[i][len + 1] == '/')
			return av[i] + len + 1;
	return NULL;
}

static int env_true(const char *value)
{
	return strcmp(value, "1") == 0 || strcasecmp(value, "true") == 0 ||
	       strcasecmp(value, "yes") == 0 || strcasecmp(value, "on") == 0;
}

static int opted_in(spank_t sp)
{
	char value[1024];

	if (spank_getenv(sp, "CEDANA_ENABLE", value, sizeof(value)) == ESPANK_SUCCESS &&
	    env_true(value))
		return 1;
	return spank_getenv(sp, "CEDANA_CHECKPOINT", value, sizeof(value)) == ESPANK_SUCCESS &&
	       value[0] != '\0';
}

/* The runner runs as root: only a root-owned file nobody else may write. */
static int runner_trusted(const char *path)
{
	struct stat st;

	if (stat(path, &st) < 0) {
		slurm_error("cedana: runner %s: %s; job runs without checkpoints", path,
			    strerror(errno));
		return 0;
	}
	if (!S_ISREG(st.st_mode) || st.st_uid != 0 || (st.st_mode & (S_IWGRP | S_IWOTH)) ||
	    !(st.st_mode & S_IXUSR)) {
		slurm_error("cedana: runner %s is not a root-owned executable writable only by "
			    "root; job runs without checkpoints", path);
		return 0;
	}
	return 1;
}

int slurm_spank_task_init_privileged(spank_t sp, int ac, char **av)
{
	uint32_t step;

	hand_over = 0;
	if (!spank_remote(sp) || !opted_in(sp))
		return ESPANK_SUCCESS;
	if (spank_get_item(sp, S_JOB_STEPID, &step) != ESPANK_SUCCESS ||
	    step != SLURM_BATCH_SCRIPT)
		return ESPANK_SUCCESS;
	if (!path_arg(ac, av, "runner")) {
		slurm_error("cedana: plugstack.conf gives no runner=/ABSOLUTE/PATH; job runs "
			    "without checkpoints");
		return ESPANK_SUCCESS;
	}
	if (prctl(PR_SET_KEEPCAPS, 1L, 0L, 0L, 0L) < 0) {
		slurm_error("cedana: prctl(PR_SET_KEEPCAPS): %s; job runs without checkpoints",
			    strerror(errno));
		return ESPANK_SUCCESS;
	}
	hand_over = 1;
	return ESPANK_SUCCESS;
}

static int raise_setid_caps(void)
{
	struct __user_cap_header_struct head = {_LINUX_CAPABILITY_VERSION_3, 0};
	struct __user_cap_data_struct data[2];

	if (syscall(SYS_capget, &head, data) < 0)
		return -1;
	data[0].effective |= data[0].permitted &
			     ((1U << CAP_SETUID) | (1U << CAP_SETGID));
	return (int)syscall(SYS_capset, &head, data);
}

static int drop_all_caps(void)
{
	struct __user_cap_header_struct head = {_LINUX_CAPABILITY_VERSION_3, 0};
	struct __user_cap_data_struct data[2];

	memset(data, 0, sizeof(data));
	return (int)syscall(SYS_capset, &head, data);
}

/*
 * Back to exactly the user Slurm made us, with no capability left (KEEPCAPS kept
 * the permitted set); failing that the task must not run at all.
 */
static int become_user_again(int identity_changed, uid_t uid, gid_t gid, int ngids,
			     const gid_t *gids)
{
	if (prctl(PR_SET_KEEPCAPS, 0L, 0L, 0L, 0L) < 0)
		goto fail;
	if (identity_changed && (raise_setid_caps() < 0 || setgroups((size_t)ngids, gids) < 0 ||
				 setresgid(gid, gid, gid) < 0 || setresuid(uid, uid, uid) < 0))
		goto fail;
	if (drop_all_caps() < 0)
		goto fail;
	return ESPANK_SUCCESS;
fail:
	slurm_error("cedana: cannot return to uid %u without privileges: %s", (unsigned)uid,
		    strerror(errno));
	return ESPANK_ERROR;
}

static char *format_gids(int ngids, const gid_t *gids)
{
	char *out = calloc((size_t)ngids + 1, 12);
	size_t len = 0;

	if (!out)
		return NULL;
	for (int i = 0; i < ngids; i++)
		len += (size_t)sprintf(out + len, "%s%u", i ? "," : "", (unsigned)gids[i]);
	return out;
}

/*
 * The job's environment goes to the runner on a memfd, never as the runner's own
 * environment: the runner is a root Python, and a user's LD_PRELOAD, PYTHONPATH or
 * PYTHONHOME would act on the loader and interpreter before any of its code runs.
 */
static int job_env_fd(char **env)
{
	int fd = memfd_create("cedana-job-env", 0);

	if (fd < 0)
		return -1;
	for (size_t i = 0; env && env[i]; i++) {
		size_t len = strlen(env[i]) + 1; /* with its NUL separator */
		const char *p = env[i];

		while (len > 0) {
			ssize_t w = write(fd, p, len);

			if (w < 0) {
				close(fd);
				return -1;
			}
			p += w;
			len -= (size_t)w;
		}
	}
	if (lseek(fd, 0, SEEK_SET) < 0) {
		close(fd);
		return -1;
	}
	return fd;
}

static char *const runner_envp[] = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "CEDANA_SLURM=1",
				    NULL};

/* Returns only on failure: 1 when the process identity was already changed. */
static int exec_runner(spank_t sp, const char *runner, const char *config, uid_t uid, gid_t gid,
		       int ngids, const gid_t *gids)
{
	uint32_t job_id;
	int argc = 0;
	char **argv = NULL, **env = NULL, **args;
	char job[16], uid_s[16], gid_s[16], env_fd_s[16], cwd[PATH_MAX], *gid_list;
	int env_fd;
	int n = 0, changed = 0;

	if (spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_ARGV, &argc, &argv) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_ENV, &env) != ESPANK_SUCCESS || argc < 1 ||
	    !getcwd(cwd, sizeof(cwd))) {
		slurm_error("cedana: cannot read the job's id, argv, environment or cwd; job "
			    "runs without checkpoints");
		return 0;
	}
	snprintf(job, sizeof(job), "%u", job_id);
	snprintf(uid_s, sizeof(uid_s), "%u", (unsigned)uid);
	snprintf(gid_s, sizeof(gid_s), "%u", (unsigned)gid);
	gid_list = format_gids(ngids, gids);
	env_fd = job_env_fd(env);
	if (env_fd < 0) {
		slurm_error("cedana: cannot pass the job's environment: %s; job runs without "
			    "checkpoints", strerror(errno));
		return 0;
	}
	snprintf(env_fd_s, sizeof(env_fd_s), "%d", env_fd);
	args = calloc((size_t)argc + 22, sizeof(char *));
	if (!gid_list || !args) {
		slurm_error("cedana: out of memory; job runs without checkpoints");
		return 0;
	}
	args[n++] = (char *)runner;
	args[n++] = "--job-id";
	args[n++] = job;
	args[n++] = "--step-id";
	args[n++] = "batch";
	args[n++] = "--uid";
	args[n++] = uid_s;
	args[n++] = "--gid";
	args[n++] = gid_s;
	if (ngids > 0) {
		args[n++] = "--gids";
		args[n++] = gid_list;
	}
	args[n++] = "--cwd";
	args[n++] = cwd;
	args[n++] = "--env-fd";
	args[n++] = env_fd_s;
	if (config) {
		args[n++] = "--config";
		args[n++] = (char *)config;
	}
	args[n++] = "--";
	for (int i = 0; i < argc; i++)
		args[n++] = argv[i];
	args[n] = NULL;

	if (raise_setid_caps() < 0)
		goto fail;
	if (setresgid(0, 0, 0) < 0 || setgroups(0, NULL) < 0 || setresuid(0, 0, 0) < 0) {
		changed = 1;
		goto fail;
	}
	execve(runner, args, runner_envp);
	changed = 1;
fail:
	close(env_fd);
	slurm_error("cedana: cannot hand over to %s: %s; job runs without checkpoints", runner,
		    strerror(errno));
	return changed;
}

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	const char *runner = path_arg(ac, av, "runner");
	uid_t uid = getuid();
	gid_t gid = getgid();
	gid_t gids[MAX_GIDS];
	int ngids, changed = 0;

	if (!hand_over)
		return ESPANK_SUCCESS;
	hand_over = 0;
	ngids = getgroups(MAX_GIDS, gids);
	if (ngids < 0) {
		slurm_error("cedana: getgroups: %s; job runs without checkpoints",
			    strerror(errno));
		return become_user_again(0, uid, gid, 0, gids);
	}
	if (runner && runner_trusted(runner))
		changed = exec_runner(sp, runner, path_arg(ac, av, "config"), uid, gid, ngids,
				      gids);
	return become_user_again(changed, uid, gid, ngids, gids);
}
