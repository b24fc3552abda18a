//! `kiln.v1.Tokenization` and `kiln.v1.Models`: the served model's tokenizer, limits,
//! defaults and KV cache, as clients need them to build valid requests.

use std::sync::Arc;

use kiln_tokenizer::DecodeOptions;
use tonic::{Request, Response, Status};

use crate::convert::{self, u32_sat};
use crate::pb;
use crate::server::State;
use crate::status::{from_api, from_api_in, from_engine, invalid};

#[derive(Debug)]
pub(crate) struct TokenizationService {
    pub state: Arc<State>,
}

impl TokenizationService {
    fn tokenize(&self, r: &pb::TokenizeRequest) -> Result<pb::TokenizeResponse, Status> {
        let engine = self.state.loaded()?;
        let tok = engine.tokenizer();
        let token_ids = match &r.input {
            None => return Err(invalid("input", "missing: set text or chat")),
            Some(pb::tokenize_request::Input::Text(t)) => {
                tok.encode(t).map_err(|e| invalid("text", e))?
            }
            // As Generate tokenizes it.
            Some(pb::tokenize_request::Input::Chat(c)) => {
                convert::chat(tok, engine.info(), c, &self.state.cfg)
                    .map_err(|e| from_api_in(&e, "chat", false))?
                    .ids
            }
        };
        let tokens = if r.return_tokens {
            token_ids
                .iter()
                .map(|&id| tok.id_to_token(id).unwrap_or_default())
                .collect()
        } else {
            Vec::new()
        };
        Ok(pb::TokenizeResponse { token_ids, tokens })
    }

    fn detokenize(&self, r: &pb::DetokenizeRequest) -> Result<pb::DetokenizeResponse, Status> {
        let engine = self.state.loaded()?;
        let vocab = engine.info().vocab_size;
        if let Some(bad) = r.token_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid(
                "token_ids",
                format!("token id {bad} is outside the vocabulary (0..{vocab})"),
            ));
        }
        let text = engine
            .tokenizer()
            .decode_with(
                &r.token_ids,
                DecodeOptions {
                    skip_special_tokens: r.skip_special_tokens.unwrap_or(true),
                },
            )
            .map_err(|e| invalid("token_ids", e))?;
        Ok(pb::DetokenizeResponse { text })
    }
}

#[tonic::async_trait]
impl pb::tokenization_server::Tokenization for TokenizationService {
    async fn tokenize(
        &self,
        request: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        let result = TokenizationService::tokenize(self, request.get_ref());
        self.state
            .record("/kiln.v1.Tokenization/Tokenize", result.as_ref().err());
        result.map(Response::new)
    }

    async fn detokenize(
        &self,
        request: Request<pb::DetokenizeRequest>,
    ) -> Result<Response<pb::DetokenizeResponse>, Status> {
        let result = TokenizationService::detokenize(self, request.get_ref());
        self.state
            .record("/kiln.v1.Tokenization/Detokenize", result.as_ref().err());
        result.map(Response::new)
    }
}

#[derive(Debug)]
pub(crate) struct ModelsService {
    pub state: Arc<State>,
}

impl ModelsService {
    async fn info(&self, r: &pb::GetModelInfoRequest) -> Result<pb::ModelInfo, Status> {
        let cfg = &self.state.cfg;
        cfg.api
            .check_model(Some(&r.model_id))
            .map_err(|e| from_api(&e))?;
        let engine = self.state.loaded()?;
        let info = engine.info();
        let stats = engine.stats().await.map_err(from_engine)?;
        Ok(pb::ModelInfo {
            model_id: cfg.api.model_id().to_owned(),
            architecture: cfg.architecture.clone(),
            context_length: u32_sat(info.max_model_len),
            vocab_size: u32_sat(info.vocab_size),
            eos_token_ids: info.eos_ids.clone(),
            bos_token_id: info.bos,
            limits: Some(pb::Limits {
                max_new_tokens: u32_sat(cfg.api.max_tokens_limit(info)),
                default_max_new_tokens: u32_sat(convert::default_max_new_tokens(cfg, info)),
                max_n: u32_sat(info.max_n),
                max_stop_strings: u32_sat(info.max_stop_strings),
                max_top_logprobs: u32_sat(info.max_top_logprobs),
                max_num_seqs: u32_sat(info.max_num_seqs),
                max_num_batched_tokens: u32_sat(info.max_num_batched_tokens),
                max_waiting: u32_sat(info.max_waiting),
                max_request_bytes: u32_sat(cfg.api.max_request_bytes),
                max_response_bytes: u32_sat(cfg.max_response_bytes),
            }),
            default_sampling: Some(convert::default_sampling(&cfg.api.default_sampling)),
            kv_cache: Some(pb::KvCacheInfo {
                block_size: u32_sat(info.block_size),
                total_blocks: u32_sat(stats.kv.total_blocks),
                usable_blocks: u32_sat(info.usable_blocks),
                dtype: info.kv_dtype.to_owned(),
                bytes_per_token: info.kv_bytes_per_token,
                used_blocks: u32_sat(stats.kv.used_blocks),
                free_blocks: u32_sat(stats.kv.free_blocks + stats.kv.evictable_blocks),
                cached_blocks: u32_sat(stats.kv.evictable_blocks),
                running_requests: u32_sat(stats.running),
                waiting_requests: u32_sat(stats.waiting + stats.preempted),
            }),
            device: info.device.clone(),
        })
    }
}

#[tonic::async_trait]
impl pb::models_server::Models for ModelsService {
    async fn get_model_info(
        &self,
        request: Request<pb::GetModelInfoRequest>,
    ) -> Result<Response<pb::ModelInfo>, Status> {
        let result = self.info(request.get_ref()).await;
        self.state
            .record("/kiln.v1.Models/GetModelInfo", result.as_ref().err());
        result.map(Response::new)
    }
}
