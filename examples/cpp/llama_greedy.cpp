// Greedy generation with llama.cpp, printing the token ids: what scripts/gpu.sh's `llama`
// section runs without and under the LD_PRELOAD shim, the two lists compared for equality.
//
//   llama_greedy -m MODEL.gguf [-n N_PREDICT] [-ngl N_GPU_LAYERS] [-c N_CTX] [-b N_BATCH] [-p PROMPT]
//
// Built against libllama alone (llama.h; no common/), as llama.cpp's examples/simple is, whose
// calls it follows: the prompt is tokenized with BOS, decoded as one batch, then N_PREDICT
// tokens are sampled with the greedy sampler (the largest logit; no seed plays a part) and
// decoded one at a time; an end-of-generation token stops early. Flash attention is off (the
// section builds ggml's CUDA backend without its kernels, GGML_CUDA_FA=OFF).
//
// stdout: one line `tokens: ID ID ...` (the generated tokens), then `text: ...` (their pieces).
// stderr: llama.cpp's log, then `llama_greedy: prompt P tokens, X t/s; generated G tokens, Y t/s`
// from llama.cpp's own timings (llama_perf_context). Exit status 1 on any failure, named.
#include "llama.h"

#include <clocale>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static void batch_set_tokens(llama_batch_ext * batch, const llama_token * tokens, int32_t n, llama_pos pos_0) {
    llama_batch_ext_clear(batch);
    for (int32_t i = 0; i < n; ++i) {
        const int32_t idx = llama_batch_ext_add_token(batch, 0, tokens[i]);
        const llama_pos pos = pos_0 + i;
        llama_batch_ext_set_pos(batch, idx, &pos);
    }
    llama_batch_ext_set_output_logits(batch, n - 1, true);
}

static int usage(const char * argv0) {
    fprintf(stderr, "usage: %s -m MODEL.gguf [-n N_PREDICT] [-ngl N_GPU_LAYERS] [-c N_CTX] [-b N_BATCH] [-p PROMPT]\n",
            argv0);
    return 1;
}

int main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");
    std::string model_path;
    std::string prompt = "hello world, the model made the memory of the device cache";
    int ngl = 99, n_predict = 64, n_ctx = 4096, n_batch = 512;
    for (int i = 1; i < argc; i++) {
        const char * a = argv[i];
        if (i + 1 >= argc) {
            return usage(argv[0]);
        }
        const char * v = argv[++i];
        if (!strcmp(a, "-m")) {
            model_path = v;
        } else if (!strcmp(a, "-p")) {
            prompt = v;
        } else if (!strcmp(a, "-n")) {
            n_predict = atoi(v);
        } else if (!strcmp(a, "-ngl")) {
            ngl = atoi(v);
        } else if (!strcmp(a, "-c")) {
            n_ctx = atoi(v);
        } else if (!strcmp(a, "-b")) {
            n_batch = atoi(v);
        } else {
            return usage(argv[0]);
        }
    }
    if (model_path.empty() || n_predict < 1 || n_ctx < 1 || n_batch < 1) {
        return usage(argv[0]);
    }

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = ngl;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) {
        fprintf(stderr, "llama_greedy: cannot load %s\n", model_path.c_str());
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_prompt = -llama_tokenize(vocab, prompt.c_str(), prompt.size(), NULL, 0, true, true);
    std::vector<llama_token> prompt_tokens(n_prompt);
    if (llama_tokenize(vocab, prompt.c_str(), prompt.size(), prompt_tokens.data(), n_prompt, true, true) < 0) {
        fprintf(stderr, "llama_greedy: the prompt does not tokenize\n");
        return 1;
    }
    if (n_prompt + n_predict > n_ctx || n_prompt > n_batch) {
        fprintf(stderr, "llama_greedy: %d prompt tokens and %d to generate do not fit -c %d, -b %d\n", n_prompt,
                n_predict, n_ctx, n_batch);
        return 1;
    }

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = n_batch;
    cp.n_ubatch = n_batch;
    cp.no_perf = false;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "llama_greedy: cannot create the context\n");
        return 1;
    }
    llama_sampler_chain_params sp = llama_sampler_chain_default_params();
    sp.no_perf = false;
    llama_sampler * smpl = llama_sampler_chain_init(sp);
    llama_sampler_chain_add(smpl, llama_sampler_init_greedy());

    llama_batch_ext * batch = llama_batch_ext_init(ctx);
    batch_set_tokens(batch, prompt_tokens.data(), n_prompt, 0);
    std::vector<llama_token> out;
    std::string text;
    int n_pos = 0, n_tokens = n_prompt;
    while ((int) out.size() < n_predict) {
        if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch)) {
            fprintf(stderr, "llama_greedy: decode failed at position %d\n", n_pos);
            return 1;
        }
        n_pos += n_tokens;
        llama_token id = llama_sampler_sample(smpl, ctx, -1);
        out.push_back(id);
        char buf[256];
        const int n = llama_token_to_piece(vocab, id, buf, sizeof(buf), 0, true);
        if (n > 0) {
            text.append(buf, n);
        }
        if (llama_vocab_is_eog(vocab, id)) {
            break;
        }
        batch_set_tokens(batch, &id, 1, n_pos);
        n_tokens = 1;
    }

    printf("tokens:");
    for (llama_token id : out) {
        printf(" %d", id);
    }
    printf("\ntext: ");
    for (unsigned char c : text) {  // the pieces, bytes outside printable ASCII escaped
        if (c >= 32 && c < 127 && c != '\\') {
            putchar(c);
        } else {
            printf("\\x%02x", c);
        }
    }
    printf("\n");
    const llama_perf_context_data perf = llama_perf_context(ctx);
    fprintf(stderr, "llama_greedy: prompt %d tokens, %.1f t/s; generated %d tokens, %.1f t/s\n", perf.n_p_eval,
            perf.t_p_eval_ms > 0 ? 1e3 * perf.n_p_eval / perf.t_p_eval_ms : 0.0, perf.n_eval,
            perf.t_eval_ms > 0 ? 1e3 * perf.n_eval / perf.t_eval_ms : 0.0);

    llama_batch_ext_free(batch);
    llama_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
