/* A two-turn chat through sieve's C API, streamed, on a bounded KV cache.
 *
 *   cargo build --release -p sieve-c
 *   cc -std=c11 -Wall -Wextra examples/c/chat.c -Ibindings/c/include \
 *      -Ltarget/release -lsieve_c -Wl,-rpath,"$PWD/target/release" -o chat
 *   ./chat [MODEL] [QUESTION]
 *
 * MODEL defaults to models/smollm2-135m-instruct (scripts/setup.sh). */
#include <stdio.h>
#include <stdlib.h>

#include "sieve.h"

/* Prints each piece as it comes; returning false would stop the answer. */
static bool print_piece(const char *piece, size_t len, void *user_data) {
    (void)user_data;
    fwrite(piece, 1, len, stdout);
    fflush(stdout);
    return true;
}

static int fail(const char *what, sieve_status status) {
    fprintf(stderr, "%s failed (%d): %s\n", what, (int)status, sieve_last_error());
    return 1;
}

int main(int argc, char **argv) {
    const char *model = argc > 1 ? argv[1] : "models/smollm2-135m-instruct";
    const char *questions[2] = {argc > 2 ? argv[2] : "What is the capital of France?",
                                "And of Italy?"};
    fprintf(stderr, "sieve %s\n", sieve_version());

    sieve_llm *llm = NULL;
    sieve_status st = sieve_llm_load(model, NULL, &llm);
    if (st != SIEVE_OK) return fail("sieve_llm_load", st);

    /* At most 512 + 64 cache entries, however long the conversation. */
    sieve_session_options so = sieve_session_options_default();
    so.policy = "epikv";
    so.budget = 512;
    sieve_session *session = NULL;
    st = sieve_session_new(llm, &so, &session);
    if (st != SIEVE_OK) {
        sieve_llm_free(&llm);
        return fail("sieve_session_new", st);
    }

    sieve_generate_options go = sieve_generate_options_default();
    go.max_tokens = 64;
    int code = 0;
    for (int turn = 0; turn < 2 && code == 0; turn++) {
        sieve_generation_stats stats;
        st = sieve_session_chat(session, questions[turn], &go, print_piece, NULL, &stats);
        if (st != SIEVE_OK) {
            code = fail("sieve_session_chat", st);
            break;
        }
        double rate = stats.decode_seconds > 0
                          ? (double)(stats.generated_tokens - 1) / stats.decode_seconds
                          : 0.0;
        printf("\n[%zu prompt tokens, %zu generated, %.1f tok/s]\n", stats.prompt_tokens,
               stats.generated_tokens, rate);
    }
    sieve_session_free(&session);
    sieve_llm_free(&llm);
    return code;
}
