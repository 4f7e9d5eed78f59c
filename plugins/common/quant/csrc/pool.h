/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * the thread pool that runs every job. */

static void run_items(const job_t *job, long i0, long i1) {
    if (job->kind == 0)
        run_columns(&job->mm, i0, i1);
    else if (job->kind == 1)
        attention_items(&job->at, i0, i1);
    else if (job->kind == 2)
        for (long r = i0; r < i1; r++) job->am.out[r] = argmax_row(job->am.x + r * job->am.n, job->am.n);
    else
        job->it.fn(job->it.arg, i0, i1);
}

/* ---- a small pool ----
 * A job's items are cut into chunks that the caller and the helpers claim one at a time, so a
 * helper that the OS has not scheduled (a busy machine) leaves its share to the others instead
 * of stalling the caller. After a job a helper busy-waits for the next one for a while (a decode
 * step calls again within microseconds), yielding its core to other runnable threads, then sleeps
 * on a condition variable. One caller at a time uses the pool; a concurrent caller computes alone.
 * Chunks never change an item's arithmetic. */

#define MAX_HELPERS 63
#define SPIN_NS 50000L            /* pure spinning after a job */
#define YIELD_NS 2000000L         /* then spinning with sched_yield, then sleeping */
#define MIN_WORK_PER_SHARE 1024L  /* in 32-multiply-add units: smaller shares are not worth a hand-off */
#define CHUNKS_PER_SHARE 8

static pthread_mutex_t pool_use = PTHREAD_MUTEX_INITIALIZER;   /* held by the caller using the pool */
static pthread_mutex_t pool_sleep = PTHREAD_MUTEX_INITIALIZER; /* guards the sleeping helpers' wake-up */
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static _Atomic uint64_t pool_ticket;   /* (job number << 32) | next chunk to claim */
static _Atomic long pool_done;         /* chunks of the current job finished */
static _Atomic int pool_sleepers;
static int pool_started;               /* helpers running (guarded by pool_use) */
static _Atomic int pool_wanted = 1;    /* threads per call, the caller included */
static job_t pool_job;                 /* the current job: written before its ticket is published */
static long pool_chunks;

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Claim the next chunk of job `seq`; 0 when that job is over or another one has replaced it. */
static int claim(uint32_t seq, long *chunk) {
    uint64_t t = atomic_load_explicit(&pool_ticket, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(t >> 32) != seq || (long)(t & 0xFFFFFFFFu) >= pool_chunks) return 0;
        if (atomic_compare_exchange_weak_explicit(&pool_ticket, &t, t + 1, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            *chunk = (long)(t & 0xFFFFFFFFu);
            return 1;
        }
    }
}

/* Claim and run chunks of job `seq` until none is left. */
static void work_on(uint32_t seq) {
    long chunk;
    while (claim(seq, &chunk)) {
        long count = pool_job.count;
        run_items(&pool_job, count * chunk / pool_chunks, count * (chunk + 1) / pool_chunks);
        atomic_fetch_add_explicit(&pool_done, 1, memory_order_release);
    }
}

static uint32_t current_job(void) { return (uint32_t)(atomic_load(&pool_ticket) >> 32); }

static void wait_for_job(uint32_t seen) {
    long start = now_ns();
    unsigned spins = 0;
    while (current_job() == seen) {
        cpu_relax();
        if (++spins % 256) continue;
        long waited = now_ns() - start;
        if (waited < SPIN_NS) continue;
        if (waited < YIELD_NS) {
            sched_yield();
            continue;
        }
        pthread_mutex_lock(&pool_sleep);
        atomic_fetch_add(&pool_sleepers, 1);
        while (current_job() == seen) pthread_cond_wait(&pool_wake, &pool_sleep);
        atomic_fetch_sub(&pool_sleepers, 1);
        pthread_mutex_unlock(&pool_sleep);
    }
}

static void *helper_main(void *arg) {
    uint32_t seen = (uint32_t)(uintptr_t)arg; /* the job number when this helper was created */
    for (;;) {
        wait_for_job(seen);
        seen = current_job();
        work_on(seen);
    }
    return NULL;
}

static void child_after_fork(void) {
    /* helpers do not survive fork(): the child starts without any */
    pool_started = 0;
    pthread_mutex_init(&pool_use, NULL);
    pthread_mutex_init(&pool_sleep, NULL);
    pthread_cond_init(&pool_wake, NULL);
    atomic_store(&pool_sleepers, 0);
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, child_after_fork); }

/* Threads per call, the caller included (1: no helpers). Helpers start on first use. */
void ifb_qk_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_HELPERS + 1) n = MAX_HELPERS + 1;
    atomic_store(&pool_wanted, n);
}

int ifb_qk_get_threads(void) { return atomic_load(&pool_wanted); }

/* Run `job`'s items, over the pool when `work` (in 32-multiply-add units) is large enough. */
static void run_job(const job_t *job, long work) {
    long shares = atomic_load(&pool_wanted);
    if (shares > work / MIN_WORK_PER_SHARE) shares = work / MIN_WORK_PER_SHARE;
    if (shares > job->count) shares = job->count;
    if (shares <= 1 || pthread_mutex_trylock(&pool_use) != 0) {
        run_items(job, 0, job->count);
        return;
    }
    pthread_once(&atfork_once, register_atfork);
    uint32_t seq = current_job() + 1;
    while (pool_started < shares - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&t, &attr, helper_main, (void *)(uintptr_t)(seq - 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool_started++;
    }
    /* an elementwise step is over in microseconds: two chunks a thread keep its claims few */
    long chunks = (pool_started + 1) * (job->kind == 3 ? 2 : CHUNKS_PER_SHARE);
    pool_job = *job;
    pool_chunks = chunks < job->count ? chunks : job->count;
    atomic_store_explicit(&pool_done, 0, memory_order_relaxed);
    pthread_mutex_lock(&pool_sleep);
    atomic_store_explicit(&pool_ticket, (uint64_t)seq << 32, memory_order_release);
    if (atomic_load(&pool_sleepers) > 0) pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_sleep);
    work_on(seq);
    /* a helper may still be inside the last chunks it claimed */
    while (atomic_load_explicit(&pool_done, memory_order_acquire) < pool_chunks) cpu_relax();
    /* Close the job before the next one rewrites pool_job and pool_chunks: a helper still
     * looping on this job's ticket must not take a chunk number below the next job's count
     * for one of this job's (it would run a half-written job). */
    atomic_store_explicit(&pool_ticket, ((uint64_t)seq << 32) | 0xFFFFFFFFu, memory_order_release);
    pthread_mutex_unlock(&pool_use);
}

static void run_elementwise(void (*fn)(const void *arg, long i0, long i1), const void *arg, long count,
                            long work) {
    job_t job = {.kind = 3, .count = count, .it = {fn, arg}};
    run_job(&job, work);
}
