//! One simulated gateway: kvgate's fleet state, fed the agents' reports as they reach it (every
//! gateway keeps one, whatever routes, as the real gateway would), and the router that decides
//! where its requests go, with that router's own state.

use crate::lookahead;
use crate::peers::{random_draw, CacheAware, ConsistentHash, Dynamo, Llmd};
use crate::routers::{Router, Routes, Turn};
use kvgate_bench::Job;
use kvgate_policies::{Ask, FleetState, ReplicaId, ReplicaSpec, ReportAges, RequestFeatures};
use kvgate_protocol::telemetry::{KvUpdate, TelemetryReport};
use kvgate_protocol::HashSeed;
use std::collections::BTreeMap;
use std::sync::Arc;

/// What every gateway of a run shares.
#[derive(Debug, Clone)]
pub(crate) struct Served {
    pub model: String,
    pub seed: HashSeed,
    pub block_size: usize,
}

/// A request as a gateway sees it.
pub(crate) struct Incoming<'a> {
    pub id: u64,
    pub turn: Turn,
    pub prompt: &'a [u32],
    pub job: &'a Job,
    pub now_us: u64,
}

enum Routing {
    Kvgate,
    RoundRobin,
    LeastLoad,
    CacheAware(CacheAware),
    ConsistentHash(ConsistentHash),
    Llmd(Llmd),
    Dynamo(Dynamo),
    SoonestFirstToken,
    Replay(Arc<Routes>),
}

pub(crate) struct Gateway {
    pub fleet: FleetState,
    routing: Routing,
    /// Requests this gateway has in flight on each replica.
    in_flight: Vec<u32>,
    /// Requests it has sent.
    sent: usize,
    /// Its last kvgate decision, kept for the other gateways when gateways exchange them.
    pub outbox: Option<(usize, RequestFeatures)>,
    shares: bool,
}

impl Gateway {
    /// `peers`: the other gateways its kvgate decisions go to (see [`Gateway::outbox`]).
    pub fn new(
        router: &Router,
        specs: &[(ReplicaId, ReplicaSpec)],
        ages: ReportAges,
        served: &Served,
        peers: u32,
    ) -> Self {
        let shares = peers > 0;
        let n = specs.len();
        let policy = match router {
            Router::Kvgate(policy) => (**policy).clone(),
            _ => Default::default(),
        };
        let mut fleet = FleetState::new(policy, Some(ages));
        fleet.set_replicas(specs.to_vec());
        fleet.set_peer_group(peers + 1);
        let routing = match router {
            Router::Kvgate(_) => Routing::Kvgate,
            Router::RoundRobin => Routing::RoundRobin,
            Router::LeastLoad => Routing::LeastLoad,
            Router::SglangCacheAware => Routing::CacheAware(CacheAware::new(n)),
            Router::VllmConsistentHash => {
                let names: Vec<String> = specs.iter().map(|(_, s)| s.name.clone()).collect();
                Routing::ConsistentHash(ConsistentHash::new(&names))
            }
            Router::Llmd => Routing::Llmd(Llmd::new(n)),
            Router::Dynamo => Routing::Dynamo(Dynamo::new(n, served.block_size)),
            Router::SoonestFirstToken => Routing::SoonestFirstToken,
            Router::Replay(routes) => Routing::Replay(routes.clone()),
        };
        Gateway {
            fleet,
            routing,
            in_flight: vec![0; n],
            sent: 0,
            outbox: None,
            shares,
        }
    }

    /// The replica for a request, counted in flight there. `first_tokens` is what the
    /// look-ahead knows: when the request's first token would come on each replica. With a
    /// `pool` (a phase of a disaggregated fleet), only replicas with its labels, ranked by
    /// kvgate's policy (the only router a disaggregated run takes).
    pub fn route(
        &mut self,
        request: &Incoming<'_>,
        served: &Served,
        first_tokens: &dyn Fn() -> Vec<Option<f64>>,
        pool: Option<&BTreeMap<String, String>>,
    ) -> usize {
        let n = self.in_flight.len();
        let id = request.id;
        let now_ms = request.now_us / 1_000;
        let blocks =
            || kvgate_protocol::block_hashes(served.seed, request.prompt, served.block_size);
        let replica = match &mut self.routing {
            _ if pool.is_some() => self.kvgate(request, served, now_ms, pool),
            Routing::RoundRobin => self.sent % n,
            Routing::LeastLoad => {
                let load = &self.in_flight;
                (0..n)
                    .map(|k| (self.sent + k) % n)
                    .min_by_key(|&r| load[r])
                    .unwrap_or(0)
            }
            Routing::CacheAware(ca) => ca.choose(&blocks(), &self.in_flight),
            Routing::ConsistentHash(ch) => {
                let job = request.job;
                match job.session.as_ref().or(job.group.as_ref()) {
                    Some(key) => ch.choose(key.as_bytes()),
                    None => {
                        let bytes: Vec<u8> = request
                            .prompt
                            .iter()
                            .flat_map(|t| t.to_le_bytes())
                            .collect();
                        ch.choose(&bytes)
                    }
                }
            }
            Routing::Llmd(llmd) => {
                let (waiting, kv): (Vec<u32>, Vec<f64>) = (0..n)
                    .map(|r| {
                        let state = self.fleet.replica(ReplicaId(r as u32));
                        (
                            state.map_or(0, |s| s.reported_waiting()),
                            state.and_then(|s| s.reported_kv_usage()).unwrap_or(0.0),
                        )
                    })
                    .unzip();
                llmd.choose(&blocks(), &waiting, &kv, random_draw(id))
            }
            Routing::Dynamo(dynamo) => {
                dynamo.route(id, &blocks(), request.prompt.len(), now_ms, random_draw(id))
            }
            Routing::SoonestFirstToken => lookahead::choose(&first_tokens(), id as usize),
            Routing::Replay(routes) => routes
                .replica(request.turn)
                .filter(|&r| r < n)
                .unwrap_or(request.turn.job % n),
            Routing::Kvgate => self.kvgate(request, served, now_ms, None),
        };
        self.sent += 1;
        self.in_flight[replica] += 1;
        replica
    }

    fn kvgate(
        &mut self,
        request: &Incoming<'_>,
        served: &Served,
        now_ms: u64,
        pool: Option<&BTreeMap<String, String>>,
    ) -> usize {
        let policy = self.fleet.policy().config();
        let mut features = RequestFeatures::from_tokens(
            request.prompt,
            served.seed,
            served.block_size,
            policy.ring_key_chunks,
        );
        features.now_ms = now_ms;
        features.now_us = request.now_us;
        features.tie_draw = random_draw(request.id);
        features.session = request
            .job
            .session
            .as_ref()
            .map(|s| RequestFeatures::session_key(&served.model, s.as_bytes()));
        if let Some(session) = features.session {
            features.ring_key = session;
        }
        let any = BTreeMap::new();
        let ask = Ask {
            model: &served.model,
            pool: pool.unwrap_or(&any),
            features: &features,
        };
        let n = self.in_flight.len();
        let replica = self
            .fleet
            .route(request.id, &ask, now_ms, 1)
            .map_or(request.id as usize % n, |d| d.ranked[0].replica.0 as usize);
        if self.shares {
            self.outbox = Some((replica, features));
        }
        replica
    }

    /// Another gateway's decision reaches this one.
    pub fn peer_sent(&mut self, replica: usize, features: &RequestFeatures) {
        self.fleet.peer_sent(ReplicaId(replica as u32), features);
    }

    pub fn first_token(&mut self, id: u64, now_ms: u64) {
        self.fleet.first_token(id, now_ms);
        if let Routing::Dynamo(d) = &mut self.routing {
            d.first_token(id);
        }
    }

    /// A token of request `id` arrived at `now_us`, its previous one at `previous_us`.
    pub fn token(&mut self, id: u64, now_us: u64, previous_us: Option<u64>) {
        self.fleet.token(id, now_us, previous_us);
        if let Routing::Dynamo(d) = &mut self.routing {
            d.token(id);
        }
    }

    /// The request ended (finished, or refused by the engine).
    pub fn finished(&mut self, id: u64, replica: usize) {
        self.fleet.finished(id);
        self.in_flight[replica] -= 1;
        if let Routing::Dynamo(d) = &mut self.routing {
            d.finished(id);
        }
    }

    /// An agent's report reaches this gateway; true if it could not apply the KV events in
    /// sequence (the agent's next report should carry a snapshot).
    pub fn report(
        &mut self,
        replica: usize,
        report: &TelemetryReport,
        update: &KvUpdate,
        now_ms: u64,
    ) -> bool {
        let id = ReplicaId(replica as u32);
        self.fleet.report(id, report, now_ms);
        // Only the routers that read KV events index them (a gateway's index of a large fleet
        // is most of a run's memory).
        match &mut self.routing {
            Routing::Kvgate => self.fleet.kv_events(id, update).needs_snapshot,
            Routing::Dynamo(d) => d.kv_events(replica, update).needs_snapshot,
            _ => false,
        }
    }
}
