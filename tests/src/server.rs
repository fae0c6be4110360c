//! An actix server on its own thread and actix `System`, for tests that need a bound server in
//! the same process. Stopped and joined on drop.

use std::future::Future;
use std::net::SocketAddr;
use std::thread::JoinHandle;
use std::time::Duration;

use actix_web::dev::{Server, ServerHandle};

use crate::block_on_fresh_thread;

/// A running server; dropping it stops the server and joins its thread.
pub struct ThreadServer {
    /// Where it listens (loopback).
    pub addr: SocketAddr,
    handle: ServerHandle,
    thread: Option<JoinHandle<()>>,
}

impl ThreadServer {
    /// Run `build` on a new thread inside a fresh actix `System`: it binds an `HttpServer`
    /// (usually to `127.0.0.1:0`) and returns the bound address with the running server.
    /// Panics if the server does not come up within 30 s.
    pub fn start<F, Fut>(build: F) -> ThreadServer
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = (SocketAddr, Server)>,
    {
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                let (addr, server) = build().await;
                tx.send((addr, server.handle())).expect("send");
                let _ = server.await;
            })
        });
        let (addr, handle) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("server started");
        ThreadServer {
            addr,
            handle,
            thread: Some(thread),
        }
    }
}

impl Drop for ThreadServer {
    fn drop(&mut self) {
        let handle = self.handle.clone();
        block_on_fresh_thread(async move { handle.stop(false).await });
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
