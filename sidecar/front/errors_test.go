package main

import (
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// An engine's 4xx is the client's error, its 5xx the engine's; both pass through.
func TestEngineRefusalsAreClientErrors(t *testing.T) {
	for _, tc := range []struct {
		status int
		want   byte
	}{{404, outcomeClientError}, {400, outcomeClientError}, {500, outcomeEngineError}, {200, outcomeOK}} {
		engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(tc.status)
			w.Write([]byte(`{"usage":{"completion_tokens":2}}`))
		}))
		f := &front{engine: engine.URL, client: engine.Client()}
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodPost, "/v1/completions", strings.NewReader("{}"))
		outcome, _, _ := f.forward(rec, req, "/v1/completions", []byte("{}"), 1, time.Now())
		engine.Close()
		if outcome != tc.want || rec.Code != tc.status {
			t.Errorf("engine %d: outcome %q, status %d; want %q", tc.status, outcome, rec.Code, tc.want)
		}
	}
}

// An engine that cannot be reached: a 503 in vLLM's error shape that names no internals.
func TestAnUnreachableEngineGetsACleanMessage(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	f := &front{engine: "http://" + addr, client: &http.Client{}}
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodPost, "/v1/completions", strings.NewReader("{}"))
	outcome, _, _ := f.forward(rec, req, "/v1/completions", []byte("{}"), 1, time.Now())
	var doc struct {
		Error struct {
			Message string `json:"message"`
			Type    string `json:"type"`
			Code    int    `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &doc); err != nil {
		t.Fatal(err)
	}
	if outcome != outcomeEngineError || rec.Code != 503 || doc.Error.Code != 503 {
		t.Fatalf("outcome %q status %d body %s", outcome, rec.Code, rec.Body.Bytes())
	}
	if doc.Error.Message != "the inference engine is not reachable (connection refused)" ||
		strings.Contains(doc.Error.Message, addr) {
		t.Fatalf("message %q", doc.Error.Message)
	}
}
