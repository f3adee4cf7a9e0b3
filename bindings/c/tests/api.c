/* The C API's contract, checked from C: every error path returns its
 * status and a message naming what was wrong, buffers too small are
 * refused with the size needed, a callback returning false and
 * sieve_cancel (before a chat and from another thread) stop a generation,
 * freeing twice through a handle does nothing, a session outlives its
 * model, and error messages are per thread.
 *
 *   api MODEL LOGITS_OUT
 *
 * writes the float32 logits of the ids "1,2,3" to LOGITS_OUT for
 * scripts/c-api.sh to compare with `sieve logits`. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sieve.h"

static int failures = 0;

#define CHECK(cond)                                                                \
    do {                                                                           \
        if (!(cond)) {                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n", __FILE__, \
                    __LINE__, #cond, sieve_last_error());                          \
            failures++;                                                            \
        }                                                                          \
    } while (0)

/* `call` returns `status` and the message contains `needle`. */
#define EXPECT_ERROR(call, status, needle)                                        \
    do {                                                                          \
        sieve_status got_ = (call);                                               \
        if (got_ != (status) || strstr(sieve_last_error(), (needle)) == NULL) {   \
            fprintf(stderr, "%s:%d: %s gave %d \"%s\"; expected %d with \"%s\"\n", \
                    __FILE__, __LINE__, #call, (int)got_, sieve_last_error(),     \
                    (int)(status), (needle));                                     \
            failures++;                                                           \
        }                                                                         \
    } while (0)

static void progress(size_t done, size_t total, void *user_data) {
    CHECK(done <= total);
    (*(int *)user_data)++;
}

/* Stops after `*(int *)user_data` pieces. */
static bool stop_after(const char *piece, size_t len, void *user_data) {
    CHECK(piece[len] == '\0');
    int *left = user_data;
    return --*left > 0;
}

/* Appends each piece to a buffer of 4096 bytes. */
struct text {
    char bytes[4096];
    size_t len;
};

static bool collect(const char *piece, size_t len, void *user_data) {
    struct text *t = user_data;
    if (t->len + len < sizeof t->bytes) {
        memcpy(t->bytes + t->len, piece, len);
        t->len += len;
        t->bytes[t->len] = '\0';
    }
    return true;
}

static void *cancel_soon(void *session) {
    struct timespec pause = {0, 100 * 1000 * 1000};
    nanosleep(&pause, NULL);
    CHECK(sieve_cancel(session) == SIEVE_OK);
    return NULL;
}

/* Starts a thread that cancels `user_data`'s session once the first piece
 * arrived, so the cancel lands while tokens are generated. */
struct canceller {
    sieve_session *session;
    pthread_t thread;
    int started;
};

static bool start_canceller(const char *piece, size_t len, void *user_data) {
    (void)piece;
    (void)len;
    struct canceller *c = user_data;
    if (!c->started) {
        c->started = pthread_create(&c->thread, NULL, cancel_soon, c->session) == 0;
    }
    return true;
}

static void *fail_here(void *llm) {
    /* This thread's error ... */
    EXPECT_ERROR(sieve_tokenize(llm, NULL, NULL, 0, NULL), SIEVE_ERROR_INVALID_ARGUMENT,
                 "text is NULL");
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: api MODEL LOGITS_OUT\n");
        return 2;
    }
    const char *model = argv[1];
    CHECK(sieve_version()[0] >= '0' && sieve_version()[0] <= '9');
    CHECK(strcmp(sieve_last_error(), "") == 0);

    /* Loading. */
    sieve_llm *llm = NULL;
    EXPECT_ERROR(sieve_llm_load(NULL, NULL, &llm), SIEVE_ERROR_INVALID_ARGUMENT, "path");
    EXPECT_ERROR(sieve_llm_load(model, NULL, NULL), SIEVE_ERROR_INVALID_ARGUMENT, "llm");
    EXPECT_ERROR(sieve_llm_load("no/such/model", NULL, &llm), SIEVE_ERROR_MODEL_LOADING,
                 "no/such/model");
    EXPECT_ERROR(sieve_llm_load("\xff\xfe", NULL, &llm), SIEVE_ERROR_INVALID_ARGUMENT,
                 "UTF-8");
    sieve_load_options lo = sieve_load_options_default();
    lo.dtype = "q9_9";
    EXPECT_ERROR(sieve_llm_load(model, &lo, &llm), SIEVE_ERROR_INVALID_OPTIONS, "dtype");
    lo = sieve_load_options_default();
    lo.kv_dtype = "f8";
    EXPECT_ERROR(sieve_llm_load(model, &lo, &llm), SIEVE_ERROR_INVALID_OPTIONS, "kv_dtype");
    lo = sieve_load_options_default();
    lo.backend = "glide";
    EXPECT_ERROR(sieve_llm_load(model, &lo, &llm), SIEVE_ERROR_INVALID_OPTIONS, "glide");
    lo = sieve_load_options_default();
    lo.kernels = "fast";
    EXPECT_ERROR(sieve_llm_load(model, &lo, &llm), SIEVE_ERROR_INVALID_OPTIONS, "fast");
    CHECK(llm == NULL);

    int ticks = 0;
    lo = sieve_load_options_default();
    lo.progress = progress;
    lo.progress_user_data = &ticks;
    CHECK(sieve_llm_load(model, &lo, &llm) == SIEVE_OK);
    CHECK(llm != NULL);
    CHECK(ticks > 0);
    size_t vocab = sieve_llm_vocab_size(llm);
    CHECK(vocab > 1000);
    CHECK(sieve_llm_vocab_size(NULL) == 0);

    /* Tokenizing: the count first, then the ids; back to the text. */
    const char *hello = "Hello, world!";
    size_t n = 0;
    EXPECT_ERROR(sieve_tokenize(llm, hello, NULL, 0, &n), SIEVE_ERROR_BUFFER_TOO_SMALL,
                 "do not fit");
    CHECK(n > 0 && n < 16);
    uint32_t ids[16];
    size_t n2 = 0;
    CHECK(sieve_tokenize(llm, hello, ids, 16, &n2) == SIEVE_OK);
    CHECK(n2 == n);
    char back[64];
    size_t len = 0;
    EXPECT_ERROR(sieve_detokenize(llm, ids, n, back, 4, &len), SIEVE_ERROR_BUFFER_TOO_SMALL,
                 "do not fit");
    CHECK(len == strlen(hello));
    CHECK(sieve_detokenize(llm, ids, n, back, sizeof back, &len) == SIEVE_OK);
    CHECK(strcmp(back, hello) == 0);
    uint32_t bad_id = (uint32_t)vocab;
    EXPECT_ERROR(sieve_detokenize(llm, &bad_id, 1, back, sizeof back, &len),
                 SIEVE_ERROR_INVALID_OPTIONS, "outside the vocabulary");
    EXPECT_ERROR(sieve_detokenize(llm, NULL, 2, back, sizeof back, &len),
                 SIEVE_ERROR_INVALID_ARGUMENT, "ids is NULL");

    /* Logits. */
    float *logits = malloc(vocab * sizeof *logits);
    uint32_t three[3] = {1, 2, 3};
    size_t n_logits = 0;
    EXPECT_ERROR(sieve_logits(llm, three, 3, NULL, logits, vocab - 1, &n_logits),
                 SIEVE_ERROR_BUFFER_TOO_SMALL, "do not fit");
    CHECK(n_logits == vocab);
    EXPECT_ERROR(sieve_logits(llm, three, 3, NULL, NULL, vocab, &n_logits),
                 SIEVE_ERROR_INVALID_ARGUMENT, "logits is NULL");
    EXPECT_ERROR(sieve_logits(llm, three, 0, NULL, logits, vocab, &n_logits),
                 SIEVE_ERROR_INVALID_OPTIONS, "no token ids");
    EXPECT_ERROR(sieve_logits(llm, &bad_id, 1, NULL, logits, vocab, &n_logits),
                 SIEVE_ERROR_INVALID_OPTIONS, "vocab");
    sieve_session_options cache = sieve_session_options_default();
    cache.policy = "nope";
    cache.budget = 16;
    EXPECT_ERROR(sieve_logits(llm, three, 3, &cache, logits, vocab, &n_logits),
                 SIEVE_ERROR_INVALID_OPTIONS, "nope");
    CHECK(sieve_logits(llm, three, 3, NULL, logits, vocab, &n_logits) == SIEVE_OK);
    CHECK(n_logits == vocab);
    int finite = 1;
    for (size_t i = 0; i < vocab; i++) finite &= isfinite(logits[i]) != 0;
    CHECK(finite);
    FILE *out = fopen(argv[2], "wb");
    CHECK(out != NULL);
    if (out) {
        CHECK(fwrite(logits, sizeof *logits, vocab, out) == vocab);
        fclose(out);
    }
    free(logits);

    /* Session options. */
    sieve_session *s = NULL;
    sieve_session_options so = sieve_session_options_default();
    so.policy = "window";
    EXPECT_ERROR(sieve_session_new(llm, &so, &s), SIEVE_ERROR_INVALID_OPTIONS, "budget");
    so = sieve_session_options_default();
    so.budget = 128;
    EXPECT_ERROR(sieve_session_new(llm, &so, &s), SIEVE_ERROR_INVALID_OPTIONS, "policy");
    so.policy = "window";
    so.sinks = 100;
    so.recent = 100;
    EXPECT_ERROR(sieve_session_new(llm, &so, &s), SIEVE_ERROR_INVALID_OPTIONS, "sinks");
    EXPECT_ERROR(sieve_session_new(NULL, NULL, &s), SIEVE_ERROR_INVALID_ARGUMENT, "llm");
    so = sieve_session_options_default();
    so.policy = "window";
    so.budget = 128;
    so.max_context = 512;
    EXPECT_ERROR(sieve_session_new(llm, &so, &s), SIEVE_ERROR_INVALID_OPTIONS, "max_context");
    CHECK(s == NULL);

    /* A prompt longer than a small full cache. */
    so = sieve_session_options_default();
    so.max_context = 32;
    CHECK(sieve_session_new(llm, &so, &s) == SIEVE_OK);
    EXPECT_ERROR(sieve_session_chat(s, "Tell me everything you know about the history of "
                                       "the city of Paris, its people and its rivers.",
                                    NULL, NULL, NULL, NULL),
                 SIEVE_ERROR_PROMPT_TOO_LONG, "the context is 32 tokens");
    sieve_session_free(&s);
    CHECK(s == NULL);
    sieve_session_free(&s); /* a second free through the handle does nothing */
    sieve_session_free(NULL);

    /* A bounded session. */
    so = sieve_session_options_default();
    so.policy = "window";
    so.budget = 128;
    CHECK(sieve_session_new(llm, &so, &s) == SIEVE_OK);
    EXPECT_ERROR(sieve_session_chat(s, NULL, NULL, NULL, NULL, NULL),
                 SIEVE_ERROR_INVALID_ARGUMENT, "message");
    EXPECT_ERROR(sieve_session_chat(s, "\xc3\x28", NULL, NULL, NULL, NULL),
                 SIEVE_ERROR_INVALID_ARGUMENT, "UTF-8");
    sieve_generate_options go = sieve_generate_options_default();
    go.temperature = -1.0f;
    EXPECT_ERROR(sieve_session_chat(s, "Hi", &go, NULL, NULL, NULL),
                 SIEVE_ERROR_INVALID_OPTIONS, "temperature");
    go = sieve_generate_options_default();
    go.n_stop = 1;
    EXPECT_ERROR(sieve_session_chat(s, "Hi", &go, NULL, NULL, NULL),
                 SIEVE_ERROR_INVALID_ARGUMENT, "stop");

    /* The answer, and a stop string. */
    struct text answer = {{0}, 0};
    sieve_generation_stats stats;
    go = sieve_generate_options_default();
    go.max_tokens = 32;
    CHECK(sieve_session_chat(s, "What is the capital of France?", &go, collect, &answer,
                             &stats) == SIEVE_OK);
    CHECK(strstr(answer.bytes, "Paris") != NULL);
    CHECK(stats.stop == SIEVE_STOP_EOS);
    CHECK(stats.generated_tokens > 0 && stats.prompt_tokens > 0);
    CHECK(sieve_session_reset(s) == SIEVE_OK);
    const char *stops[1] = {"Paris"};
    go.stop = stops;
    go.n_stop = 1;
    answer.len = 0;
    answer.bytes[0] = '\0';
    CHECK(sieve_session_chat(s, "What is the capital of France?", &go, collect, &answer,
                             &stats) == SIEVE_OK);
    CHECK(stats.stop == SIEVE_STOP_STRING);
    CHECK(strstr(answer.bytes, "Paris") == NULL);

    /* The callback stops after 3 pieces. */
    go = sieve_generate_options_default();
    go.max_tokens = 200;
    go.ignore_eos = true;
    int left = 3;
    CHECK(sieve_session_chat(s, "Write a long story.", &go, stop_after, &left, &stats) ==
          SIEVE_OK);
    CHECK(left == 0);
    CHECK(stats.stop == SIEVE_STOP_CANCELLED);
    CHECK(stats.generated_tokens >= 3 && stats.generated_tokens < 10);

    /* A cancel before the chat is kept; reset clears it. */
    CHECK(sieve_cancel(s) == SIEVE_OK);
    CHECK(sieve_session_chat(s, "Hello", &go, NULL, NULL, &stats) == SIEVE_OK);
    CHECK(stats.stop == SIEVE_STOP_CANCELLED && stats.generated_tokens == 0);
    CHECK(sieve_cancel_reset(s) == SIEVE_OK);
    EXPECT_ERROR(sieve_cancel(NULL), SIEVE_ERROR_INVALID_ARGUMENT, "session");

    /* A cancel from another thread stops an endless answer. */
    go.max_tokens = 100000;
    struct canceller canceller = {s, 0, 0};
    CHECK(sieve_session_chat(s, "Write a long story.", &go, start_canceller, &canceller,
                             &stats) == SIEVE_OK);
    CHECK(canceller.started);
    if (canceller.started) pthread_join(canceller.thread, NULL);
    CHECK(stats.stop == SIEVE_STOP_CANCELLED);
    CHECK(stats.generated_tokens >= 1 && stats.generated_tokens < 100000);
    CHECK(sieve_cancel_reset(s) == SIEVE_OK);

    /* Error messages are per thread. */
    EXPECT_ERROR(sieve_session_reset(NULL), SIEVE_ERROR_INVALID_ARGUMENT, "session is NULL");
    pthread_t other;
    CHECK(pthread_create(&other, NULL, fail_here, llm) == 0);
    pthread_join(other, NULL);
    CHECK(strstr(sieve_last_error(), "session is NULL") != NULL);

    /* The session outlives its model. */
    sieve_llm_free(&llm);
    CHECK(llm == NULL);
    sieve_llm_free(&llm);
    go = sieve_generate_options_default();
    go.max_tokens = 4;
    CHECK(sieve_session_complete(s, "The capital of France is", &go, NULL, NULL, &stats) ==
          SIEVE_OK);
    CHECK(stats.generated_tokens == 4 && stats.stop == SIEVE_STOP_MAX_TOKENS);
    sieve_session_free(&s);

    if (failures) {
        fprintf(stderr, "%d checks failed\n", failures);
        return 1;
    }
    printf("all checks passed\n");
    return 0;
}
